"""duo_vllm.host.pinning: the target's cores stay the target's (real processes, no vLLM)."""

import os
import subprocess
import sys
import textwrap

import pytest

from duo_vllm.host.pinning import EngineCorePlace, descendants, off_target, pin_tree, process_name

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")


def test_off_target_is_every_core_but_the_targets():
    assert off_target([0, 1], [0]) == [1]
    assert off_target([0, 1, 2, 3], [0, 1]) == [2, 3]
    assert off_target([0, 1], None) is None  # vLLM binds nothing (GPU): leave all be
    assert off_target([0, 1], [0, 1]) is None  # the target has every core: nowhere to go


@needs_two
def test_pin_tree_moves_a_process_its_threads_and_its_children():
    script = textwrap.dedent("""
        import subprocess, sys, threading, time
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert child in descendants(parent.pid)
        cpu = CPUS[-1]
        assert pin_tree([parent.pid], [cpu]) == 2
        for pid in (parent.pid, child):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert os.sched_getaffinity(int(tid)) == {cpu}
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


@needs_two
def test_move_engine_core_pins_only_a_parent_named_as_vllms_engine_core():
    child = ("from duo_vllm.host.pinning import move_engine_core; "
             f"print(move_engine_core([{CPUS[-1]}]))")
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        if sys.argv[1] == "engine":
            with open("/proc/self/comm", "w") as f:
                f.write("VLLM::EngineCore")
        out = subprocess.run([sys.executable, "-c", {child!r}], capture_output=True,
                             text=True).stdout.strip()
        print(out, os.getpid(), sorted(os.sched_getaffinity(0)))
    """)
    for role in ("engine", "other"):
        out = subprocess.run([sys.executable, "-c", script, role], capture_output=True,
                             text=True, timeout=60, check=True).stdout.split()
        moved, pid, mask = out[0], out[1], " ".join(out[2:])
        if role == "engine":
            assert moved == pid and mask == f"[{CPUS[-1]}]"
        else:
            assert moved == "None" and mask == str(CPUS)


@needs_two
def test_engine_core_place_follows_the_lent_cores_and_returns_where_vllm_left_it():
    script = textwrap.dedent("""
        import threading, time
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        print(flush=True)
        time.sleep(60)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        engine.stdout.readline()  # both threads started
        tids = [int(t) for t in os.listdir(f"/proc/{engine.pid}/task")]
        assert len(tids) == 2
        place = EngineCorePlace(engine.pid, [CPUS[-1]])
        assert place.free == CPUS
        place.use(lent=False)  # the draft drafts: the engine core on its cores
        assert all(os.sched_getaffinity(t) == {CPUS[-1]} for t in tids)
        place.use(lent=True)  # the target has every core: back where vLLM left it
        assert all(os.sched_getaffinity(t) == set(CPUS) for t in tids)
    finally:
        engine.kill()
        engine.wait()


def test_process_name_of_this_process_and_of_none():
    assert process_name(os.getpid())
    assert process_name(2 ** 22 + 12345) == ""
