# Subprocesses and multiprocessing-style process pools (the default profile allows them).
import subprocess, os, sys, concurrent.futures, multiprocessing

out = subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout
py = subprocess.run([sys.executable, "-c", "print(6*7)"], capture_output=True, text=True).stdout
pid = os.fork()
if pid == 0:
    os._exit(3)
_, status = os.waitpid(pid, 0)
with subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as p:
    echoed, _ = p.communicate(b"data")
ctx = multiprocessing.get_context("fork")
with ctx.Pool(2) as pool:
    doubled = pool.map(abs, [-1, -2, -3])
print(out.strip(), py.strip(), os.waitstatus_to_exitcode(status), echoed, doubled)
