#!/usr/bin/env python3
"""Which UCX transport NIXL uses between two processes on one GPU, and at what bandwidth.

Process B READs 256 MiB of process A's VRAM through NIXL's UCX backend in 4096 descriptors of 64 KiB (the size
of a KV block of a small model), checks the bytes and reports GB/s; UCX_PROTO_INFO=y makes UCX print the
protocol it picked, from which the transports are read. One run per configuration (UCX environment + NIXL
backend parameters), plus a reference copy through CUDA IPC by torch alone.

    python3 bench/gpu/transport.py --out DIR [--configs default,err_none,ipc_get,...]

Needs torch with CUDA and NIXL (nixl-cu12/13) importable.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import time

N_DESC, DESC = 4096, 64 * 1024
REPS = 4

# name: (UCX environment, NIXL UCX backend parameters). NIXL's default error handling is `peer`.
CONFIGS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "default": ({}, {}),
    "err_none": ({}, {"ucx_error_handling_mode": "none"}),
    # UCX turns off cuda_ipc's GET (what a NIXL READ is) when NVML reports no NVLink: a single GPU, or a VM
    "ipc_get": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, {"ucx_error_handling_mode": "none"}),
    "ipc_get_peer": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, {}),
    "ipc_get_tls": ({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_TLS": "sm,self,cuda_ipc,cuda_copy"},
                    {"ucx_error_handling_mode": "none"}),
}
TRANSPORTS = ("cuda_ipc", "cuda_copy", "sysv", "posix", "cma", "tcp", "self")


def _agent(name: str, params: dict[str, str]):
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend("UCX", dict(params))          # NIXL fills in the defaults of what is not given
    return agent


def role_a(work: str, params: dict[str, str]) -> None:
    import torch
    agent = _agent("A", params)
    torch.manual_seed(1)
    src = torch.randint(0, 255, (N_DESC * DESC,), dtype=torch.uint8, device="cuda")
    agent.register_memory(agent.get_reg_descs([(src.data_ptr(), src.numel(), 0, "")], "VRAM"))
    descs = [(src.data_ptr() + i * DESC, DESC, 0) for i in range(N_DESC)]
    with open(f"{work}/a.meta.tmp", "wb") as f:
        pickle.dump({"meta": agent.get_agent_metadata(), "descs": descs, "sum": int(src.to(torch.int64).sum())}, f)
    os.rename(f"{work}/a.meta.tmp", f"{work}/a.meta")
    deadline = time.time() + 60
    while time.time() < deadline:
        if agent.get_new_notifs().get("B"):
            return
        time.sleep(0.01)
    print("A: no notification in 60s", flush=True)


def role_b(work: str, params: dict[str, str]) -> None:
    import torch
    agent = _agent("B", params)
    dst = torch.zeros(N_DESC * DESC, dtype=torch.uint8, device="cuda")
    agent.register_memory(agent.get_reg_descs([(dst.data_ptr(), dst.numel(), 0, "")], "VRAM"))
    while not os.path.exists(f"{work}/a.meta"):
        time.sleep(0.05)
    with open(f"{work}/a.meta", "rb") as f:
        a = pickle.load(f)
    peer = agent.add_remote_agent(a["meta"])
    local = agent.get_xfer_descs([(dst.data_ptr() + i * DESC, DESC, 0) for i in range(N_DESC)], "VRAM")
    remote = agent.get_xfer_descs(a["descs"], "VRAM")
    for rep in range(REPS):
        dst.zero_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, peer, b"done" if rep == REPS - 1 else b"")
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        dt = time.perf_counter() - t0
        ok = int(dst.to(torch.int64).sum()) == a["sum"]
        print(f"RESULT rep={rep} state={state} bytes_ok={ok} gbps={N_DESC * DESC / dt / 1e9:.3f} ms={dt * 1e3:.1f}",
              flush=True)
        agent.release_xfer_handle(handle)
        if state == "ERR":
            break


def torch_ipc(out: str) -> dict:
    """The ceiling: a tensor shared between two processes by CUDA IPC (torch.multiprocessing), copied once."""
    code = r"""
import time, torch, torch.multiprocessing as mp
def child(q, r):
    t = q.get(); torch.cuda.synchronize(); t0 = time.perf_counter()
    d = t.clone(); torch.cuda.synchronize(); dt = time.perf_counter() - t0
    r.put((bool(d[:4096].eq(1).all()), t.numel() / dt / 1e9))
if __name__ == "__main__":
    mp.set_start_method("spawn"); q, r = mp.Queue(), mp.Queue()
    src = torch.ones(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    p = mp.Process(target=child, args=(q, r)); p.start(); q.put(src)
    ok, gbps = r.get(timeout=60)
    print(f"RESULT rep=0 state=DONE bytes_ok={ok} gbps={gbps:.3f}", flush=True)
    p.join(10)
"""
    script = os.path.join(out, "torch_ipc.py")      # a file: spawned children re-import the main module
    with open(script, "w") as f:
        f.write(code)
    t0 = time.time()
    try:
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"name": "torch_ipc", "ok": False, "error": "timeout"}
    return {"name": "torch_ipc", "ucx_env": {}, "nixl_params": {}, "seconds": round(time.time() - t0, 1),
            **_results(proc.stdout), "error": proc.stderr[-400:] if proc.returncode else None}


def run_config(name: str, out: str) -> dict:
    env_extra, params = CONFIGS[name]
    work = os.path.join(out, f"work_{name}")
    os.makedirs(work, exist_ok=True)
    if os.path.exists(f"{work}/a.meta"):
        os.remove(f"{work}/a.meta")
    env = {**os.environ, **env_extra, "UCX_PROTO_INFO": "y"}
    arg = json.dumps(params)
    log_path = os.path.join(out, f"transport_{name}.log")
    t0 = time.time()
    with open(log_path, "w") as log:
        pa = subprocess.Popen([sys.executable, __file__, "--role", "A", "--work", work, "--params", arg], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
        pb = subprocess.Popen([sys.executable, __file__, "--role", "B", "--work", work, "--params", arg], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out_b, _ = pb.communicate(timeout=100)
            pa.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pa.kill()
            pb.kill()
            out_b = (pb.communicate()[0] or "") + "\nTIMEOUT"
    with open(log_path, "a") as log:
        log.write("\n==== B\n" + out_b)
    return {"name": name, "ucx_env": env_extra, "nixl_params": params, "seconds": round(time.time() - t0, 1),
            **_results(out_b), "transports": _transports(out_b), "timeout": "TIMEOUT" in out_b}


def _results(text: str) -> dict:
    reps = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in text.splitlines() if line.startswith("RESULT")]
    done = [r for r in reps if r.get("state") == "DONE" and r.get("bytes_ok") == "True"]
    # the first READ includes connecting and mapping the peer's memory: report the best of the later ones
    steady = [float(r["gbps"]) for r in done[1:]] or [float(r["gbps"]) for r in done]
    return {"ok": bool(done) and len(done) == len(reps), "reps": len(reps),
            "gbps_first": float(done[0]["gbps"]) if done else None, "gbps": max(steady) if steady else None}


def _transports(text: str) -> dict[str, int]:
    """How often each transport name appears in UCX's protocol-selection table lines (the `|` rows)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        for tl in TRANSPORTS:
            if re.search(rf"\b{tl}\b", line):
                counts[tl] = counts.get(tl, 0) + 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--configs", default="default,err_none,ipc_get,ipc_get_peer,ipc_get_tls")
    ap.add_argument("--role", choices=["A", "B"])
    ap.add_argument("--work")
    ap.add_argument("--params", default="{}")
    a = ap.parse_args()
    if a.role:
        (role_a if a.role == "A" else role_b)(a.work, json.loads(a.params))
        return
    os.makedirs(a.out, exist_ok=True)
    results = [torch_ipc(a.out)]
    print(json.dumps(results[-1]), flush=True)
    for name in a.configs.split(","):
        results.append(run_config(name, a.out))
        print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(a.out, "transport.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
