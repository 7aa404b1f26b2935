# asyncio, threads, thread pools, queues, timers, sleeping.
import asyncio, concurrent.futures, queue, threading, time, signal, selectors, socket

async def work(i):
    await asyncio.sleep(0.001)
    return i * 2

async def main():
    r = await asyncio.gather(*(work(i) for i in range(50)))
    loop = asyncio.get_running_loop()
    x = await loop.run_in_executor(None, sum, range(1000))
    q = asyncio.Queue()
    await q.put(1)
    try:
        await asyncio.wait_for(asyncio.sleep(1), 0.01)
    except asyncio.TimeoutError:
        pass
    return sum(r) + x + await q.get()

total = asyncio.run(main())
results = queue.Queue()
threads = [threading.Thread(target=lambda i=i: results.put(i * i)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
with concurrent.futures.ThreadPoolExecutor(4) as ex:
    squares = list(ex.map(lambda v: v * v, range(20)))
lock = threading.Lock(); cond = threading.Condition(lock); ev = threading.Event()
threading.Timer(0.01, ev.set).start(); ev.wait(1)
a, b = socket.socketpair(); a.sendall(b"ping"); sel = selectors.DefaultSelector()
sel.register(b, selectors.EVENT_READ); sel.select(1); b.recv(4); a.close(); b.close()
signal.signal(signal.SIGUSR1, lambda *a: None); signal.raise_signal(signal.SIGUSR1)
signal.setitimer(signal.ITIMER_REAL, 0)
print(total, results.qsize(), sum(squares), time.perf_counter() > 0)
