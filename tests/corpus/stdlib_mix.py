# Everyday standard-library work an LLM writes: text, data, dates, hashing, compression.
import base64, bisect, collections, csv, dataclasses, datetime, decimal, difflib, enum, fractions
import functools, gzip, hashlib, heapq, hmac, io, itertools, json, lzma, bz2, math, operator
import pathlib, pprint, random, re, secrets, statistics, string, struct, tempfile, textwrap
import time, typing, unicodedata, urllib.parse, uuid, zlib, html, xml.etree.ElementTree as ET
import sqlite3, pickle, copy, shutil, glob, os, locale, calendar, zoneinfo, platform, inspect

rows = [{"name": f"item{i}", "price": i * 1.5, "when": datetime.date(2026, 1, 1 + i % 28).isoformat()}
        for i in range(200)]
buf = io.StringIO()
w = csv.DictWriter(buf, fieldnames=["name", "price", "when"])
w.writeheader()
w.writerows(rows)
data = buf.getvalue().encode()
assert gzip.decompress(gzip.compress(data)) == data
assert lzma.decompress(lzma.compress(data)) == data
assert bz2.decompress(bz2.compress(data)) == data
digest = hashlib.sha256(data).hexdigest() + hmac.new(b"k", data, "sha1").hexdigest()
db = sqlite3.connect(":memory:")
db.execute("create table t (name text, price real)")
db.executemany("insert into t values (?, ?)", [(r["name"], r["price"]) for r in rows])
total = db.execute("select sum(price) from t").fetchone()[0]
with tempfile.TemporaryDirectory() as d:
    p = pathlib.Path(d) / "x.json"
    p.write_text(json.dumps(rows))
    os.makedirs(os.path.join(d, "sub", "deep"))
    shutil.copy(p, os.path.join(d, "sub", "y.json"))
    found = sorted(glob.glob(os.path.join(d, "**", "*.json"), recursive=True))
    os.rename(os.path.join(d, "sub", "y.json"), os.path.join(d, "sub", "z.json"))
    os.stat(p); os.listdir(d); os.utime(p); os.chmod(p, 0o600)
    shutil.rmtree(os.path.join(d, "sub"))
root = ET.fromstring("<a><b x='1'/><b x='2'/></a>")
print(len(found), round(total, 2), digest[:8], statistics.median(r["price"] for r in rows),
      uuid.uuid4().version, secrets.token_hex(4).__len__(), len(ET.tostring(root)),
      decimal.Decimal("1.1") + decimal.Decimal("2.2"), fractions.Fraction(1, 3) * 3,
      zoneinfo.available_timezones().__len__() >= 0, platform.python_version()[:1],
      time.monotonic() > 0, random.Random(1).random() < 1, os.cpu_count() is not None)
