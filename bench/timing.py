"""Timing shared by the CPU benchmarks (run as `python bench/<script>.py`, so importable)."""
import time


def best_wall_and_cpu(fn, reps: int) -> tuple[float, float]:
    """Best wall time and best CPU time (user+sys of all threads) of `reps` calls, in seconds.
    Callers warm up first. Best-of, because others share the machine."""
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)
