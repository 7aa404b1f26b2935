# numpy and pandas: what analysis code does (needs the `data` environment).
import numpy as np
import pandas as pd

rng = np.random.default_rng(0)
a = rng.normal(size=(300, 300))
b = a @ a.T
eig = np.linalg.eigvalsh(b[:50, :50])
inv = np.linalg.inv(b[:20, :20] + np.eye(20))
fft = np.fft.rfft(a[0])
df = pd.DataFrame({"g": rng.integers(0, 5, 1000), "x": rng.normal(size=1000), "t": pd.date_range("2026-01-01", periods=1000, freq="h")})
agg = df.groupby("g")["x"].agg(["mean", "std", "count"])
pivot = df.assign(day=df.t.dt.day).pivot_table(index="g", columns="day", values="x", aggfunc="sum")
merged = df.merge(agg, left_on="g", right_index=True)
csv = df.head(50).to_csv()
back = pd.read_csv(__import__("io").StringIO(csv))
rolled = df.set_index("t")["x"].rolling("6h").mean().dropna()
print(b.shape, round(float(eig.max()), 3), inv.shape, fft.shape, agg.shape, pivot.shape, len(merged), len(back), len(rolled))
