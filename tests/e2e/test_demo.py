"""`pd-gateway demo` and the process-level first hour: the table, stopping on any signal, busy ports."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.servers import free_port, stop_process

pytestmark = pytest.mark.integration


def test_demo_prints_its_table_quickly(tmp_path):
    logs = tmp_path / "logs"
    out = subprocess.run([sys.executable, "-m", "gateway", "demo", "--log-dir", str(logs)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    # the demo's questions are short: D alone computes each later turn's suffix (the local path)
    assert [r[1:3] for r in rows] == [["full", "first_turn"]] + [["local", "short_suffix"]] * 5
    for i, row in enumerate(rows):
        prompt, reused, cached, computed, engine = int(row[3]), int(row[4]), int(row[5]), int(row[6]), row[7]
        assert reused + cached + computed == prompt, row          # the columns add up (issue 38)
        if i:   # D alone computed the new suffix (plus at most a block), counted on D: it once read P's counters
            assert engine == "D" and 0 < computed <= prompt - reused + 16, row
        else:
            assert engine == "P" and computed == prompt, row
    assert f"component logs: {logs}/" in out.stdout
    assert {p.name for p in logs.glob("*.log")} == {"prefill.log", "decode.log", "gateway.log"}


def test_demo_leaves_no_folder_behind_unless_asked(tmp_path):
    """Each run used to leave a /tmp/pd-gateway-demo-* folder of logs nobody asked for."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-m", "gateway", "demo"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr
    assert "component logs" not in out.stdout
    assert list(tmp.iterdir()) == []


def _interrupt(demo: subprocess.Popen) -> None:
    """What a terminal's Ctrl-C does: SIGINT to every process of the foreground process group."""
    os.killpg(demo.pid, signal.SIGINT)


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_ctrl_c_exits_cleanly_and_keeps_tracebacks_out_of_the_logs(tmp_path, when):
    """Ctrl-C reached the children too: each wrote a KeyboardInterrupt traceback into its log (one still
    importing got it mid-import), and the demo itself then failed talking to a dead engine."""
    logs = tmp_path / "logs"
    demo = subprocess.Popen([sys.executable, "-m", "gateway", "demo", "--serve", "--port", str(free_port()),
                             "--log-dir", str(logs)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)     # its own group, as a shell gives a foreground job
    children: list[int] = []
    try:
        wanted = "component logs" if when == "starting" else "serving on"
        for line in demo.stdout:
            if line.startswith(wanted):
                break
        if when == "starting":              # the engines are importing transformers: no signal handler yet
            deadline = time.monotonic() + 20
            while not children_of(demo.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
        children = children_of(demo.pid)
        assert children
        _interrupt(demo)
        output = demo.communicate(timeout=60)[0]
        assert demo.returncode == 0, output
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        for log in logs.glob("*.log"):
            text = log.read_text()
            assert "Traceback" not in text and "KeyboardInterrupt" not in text, f"{log.name}:\n{text[-2000:]}"
        assert not any(alive(c) for c in children)
    finally:
        stop_process(demo, signal.SIGKILL)
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_demo_stops_its_children_on_any_signal(sig):
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-m", "gateway", "demo", "--serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    try:
        for line in demo.stdout:
            if line.startswith("serving on"):
                break
        children = children_of(demo.pid)
        assert len(children) == 3
        demo.send_signal(sig)
        assert demo.wait(timeout=30) is not None
        deadline = time.monotonic() + 10
        while any(alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(c) for c in children)
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0          # nothing holds the demo's port
    finally:
        stop_process(demo, signal.SIGKILL)
        for pid in children:             # this test's own grandchildren, should the demo have left them
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_demo_and_serve_on_a_busy_port_say_so_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        demo = subprocess.run([sys.executable, "-m", "gateway", "demo", "--serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
        serve = subprocess.run([sys.executable, "-m", "gateway", "serve", "--prefill", "http://127.0.0.1:9",
                                "--decode", "http://127.0.0.1:9", "--host", "127.0.0.1", "--port", str(port),
                                "--health-interval-s", "60"], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PDGW_LOG_LEVEL": "critical"})
    for result, words in ((demo, f"port {port} is in use"), (serve, f"127.0.0.1:{port} is already in use")):
        assert result.returncode == 1
        assert words in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_served_demo_takes_a_coding_agents_requests():
    """What Claude Code and OpenCode send: tools with the default tool_choice (a 400 from engines without a
    tool-call parser), max_tokens 32000 on a long prompt (a 400 in a 32k context); the next turn reuses."""
    port = free_port()
    demo = subprocess.Popen([sys.executable, "-m", "gateway", "demo", "--serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in demo.stdout:
            if line.startswith("serving on"):
                break
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
        system = "You are a coding agent. " + " ".join(f"rule {i}: keep the code tidy." for i in range(2500))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is in this repo?"}]
        for turn in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="demo", messages=messages, tools=tools, max_tokens=32000,
                extra_headers={"X-Session-Id": "agent"})
            choice = raw.parse().choices[0]
            assert choice.finish_reason in ("stop", "tool_calls")
            assert raw.parse().usage.prompt_tokens > 20_000
            if turn:
                assert int(raw.headers["x-pd-reused-tokens"]) > 20_000
            messages.append(choice.message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "README.md\nsrc/"}
                         for c in choice.message.tool_calls or ()] or [{"role": "user", "content": "And then?"}]
    finally:
        stop_process(demo, signal.SIGTERM)
