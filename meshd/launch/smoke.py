"""``meshd smoke-run``: relay + orchestrator + N stages, one generation, checked
token for token against ``meshd generate``, then everything torn down.

Run-level faults name nodes by run name and are turned into each node's own
``--fault`` flags (``drop:A->B`` becomes ``drop:<B's address>`` on A), or are
carried out here (``kill:X@token-T``, ``relay-down@S``).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .local import LocalProcess, free_ports, stop_all

DEFAULT_PROMPT = "Once upon a time"
_KILL = re.compile(r"^kill:(?P<who>[\w-]+)@token-(?P<token>\d+)$")
_RELAY_DOWN = re.compile(r"^relay-down@(?P<s>\d+(\.\d+)?)$")
_DROP = re.compile(r"^drop:(?P<a>[\w-]+)->(?P<b>[\w-]+)$")


class SmokeError(Exception):
    """The run failed; ``status`` is what a person reads."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(status)
        self.status, self.reason = status, reason


class Interrupted(BaseException):
    """SIGTERM or SIGINT: tear down, then exit non-zero."""


@dataclass
class Plan:
    stages: int
    node_faults: dict[str, list[str]] = field(default_factory=dict)
    kills: list[tuple[str, int]] = field(default_factory=list)
    relay_down_s: float | None = None


def plan_faults(specs: list[str], stages: int, addrs: dict[str, str]) -> Plan:
    """Turn run-level fault specs into per-node flags and actions; ValueError names a bad one."""
    names = set(addrs)
    plan = Plan(stages)

    def node(name: str, spec: str) -> str:
        if name not in names:
            raise ValueError(f"--fault {spec}: no node named {name!r} (have {', '.join(sorted(names))})")
        return name

    for spec in specs:
        if m := _DROP.match(spec):
            a, b = node(m["a"], spec), node(m["b"], spec)
            plan.node_faults.setdefault(a, []).append(f"drop:{addrs[b]}")
        elif spec.startswith("isolate:"):
            plan.node_faults.setdefault(node(spec[8:], spec), []).append("isolate")
        elif spec.startswith(("loss:", "delay:")):
            for n in names:
                plan.node_faults.setdefault(n, []).append(spec)
        elif m := _KILL.match(spec):
            plan.kills.append((node(m["who"], spec), int(m["token"])))
        elif m := _RELAY_DOWN.match(spec):
            plan.relay_down_s = float(m["s"])
        elif spec.startswith("nat:"):
            raise ValueError(f"--fault {spec}: nat needs --provider netns")
        else:
            raise ValueError(f"--fault {spec!r}: expected drop:A->B, isolate:X, loss:P, delay:MS, "
                             "kill:X@token-T or relay-down@SECONDS")
    return plan


class Progress:
    """Live progress on a terminal; silent otherwise (and with --json)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._status = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)
            self._status = self.console.status("starting")
            self._status.start()

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def log(self, text: str) -> None:
        if self.enabled:
            self.console.log(text)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()


@dataclass(frozen=True)
class _Dashboard:
    """A node's dashboard URL and, bound beyond loopback (netns), the token it asks for."""

    url: str
    headers: dict[str, str]


def _dashboard(proc: LocalProcess, timeout: float) -> _Dashboard:
    prefix = "meshd dashboard url="
    line = proc.wait_for(lambda s: s.startswith(prefix), timeout, prefix.strip())
    url, *rest = line[len(prefix):].split()
    token = next((word[len("token="):] for word in rest if word.startswith("token=")), None)
    return _Dashboard(url, {"X-Meshd-Token": token} if token else {})


def _snapshot(client, dashboard: _Dashboard) -> dict:
    r = client.get(f"{dashboard.url}/api/snapshot", headers=dashboard.headers)
    r.raise_for_status()
    return r.json()



class Driver:
    """Carries out the run model's actions on local processes and saves the run after each step."""

    def __init__(self, run, run_dir: Path, argvs: dict[str, list[str]], envs: dict[str, dict[str, str]],
                 progress: Progress, spawn=LocalProcess) -> None:
        self.run, self.run_dir, self.argvs, self.envs = run, run_dir, argvs, envs
        self.spawn = spawn  # (name, argv, env) -> LocalProcess; the provider's way of starting a job
        self.progress = progress
        self.procs: dict[str, LocalProcess] = {}
        self._exited: set[str] = set()
        self._running: set[str] = set()

    def observe(self, *observations) -> None:
        from .model import Kill, Start, Started, Stop, step
        from .state import save_run

        pending = list(observations)
        while True:
            actions = step(self.run, pending, time.time())
            pending = []
            for action in actions:
                if isinstance(action, Start):
                    self.progress.update(f"starting {action.job}")
                    proc = self.spawn(action.job, self.argvs[action.job], self.envs.get(action.job))
                    self.procs[action.job] = proc
                    pending.append(Started(action.job, proc.proc.pid))
                elif isinstance(action, Stop) and action.job in self.procs:
                    self.procs[action.job].signal(signal.SIGTERM)
                elif isinstance(action, Kill) and action.job in self.procs:
                    self.procs[action.job].signal(signal.SIGKILL)
            save_run(self.run, self.run_dir)
            if not pending:
                return

    def poll(self) -> None:
        """Report processes that came up or went away since the last look."""
        from .model import Exited, Running

        seen = []
        for name, proc in self.procs.items():
            if name not in self._running and name != "relay" and proc.boot is None:
                with contextlib.suppress(TimeoutError, RuntimeError):
                    proc.wait_boot(0.01)
            if name not in self._running and (proc.boot is not None or (name == "relay" and proc.lines)):
                self._running.add(name)
                peer = proc.boot.prefix if proc.boot is not None else None
                address = proc.boot.addr if proc.boot is not None else None
                seen.append(Running(name, address, peer))
            if name not in self._exited and not proc.alive():
                self._exited.add(name)
                seen.append(Exited(name, proc.proc.returncode))
        if seen:
            self.observe(*seen)

    def wait_started(self, names: list[str], timeout: float) -> None:
        """Drive the startup order until every named job is up; raise SmokeError naming a laggard."""
        deadline = time.monotonic() + timeout
        while not all(n in self._running for n in names):
            self.poll()
            for n, proc in self.procs.items():
                if not proc.alive():
                    raise SmokeError(f"exited ({proc.proc.returncode})",
                                     f"{n} exited while starting: {' | '.join(proc.lines[-3:])}")
            if time.monotonic() > deadline:
                late = [n for n in names if n not in self._running]
                raise SmokeError("timeout", f"not started within {timeout:g}s: {', '.join(late)}")
            time.sleep(0.05)

    def finish(self, timeout: float = 8.0) -> int:
        """Let every job end (per the stop criteria), then make sure; returns processes left alive."""
        from .model import Finishing, StopJob

        master = self.procs.get("orchestrator")
        if master is not None and master.alive() and not self.run.reason:
            # The master's work is done: it finishes normally (master-done stops the workers).
            self.observe(Finishing("orchestrator"))
            master.signal(signal.SIGTERM)
            if self.run.stop_criteria == "all-done":
                for job in self.run.workers:
                    if job.name in self.procs and self.procs[job.name].alive():
                        self.observe(Finishing(job.name))
                        self.procs[job.name].signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.alive() for p in self.procs.values()):
            self.poll()
            if not self.run.reason and all(not p.alive() for n, p in self.procs.items() if n != "relay"):
                self.observe(StopJob("relay"))
            time.sleep(0.05)
        left = stop_all(list(self.procs.values()))
        self.poll()
        return left

def run_smoke(args) -> int:
    import httpx

    from ..pipeline.generate import generate

    stages = args.stages
    quiet = args.json or not sys.stderr.isatty()
    progress = Progress(not quiet)
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="meshd-smoke-"))
    procs: list[LocalProcess] = []
    result: dict = {"ok": False, "status": "failed", "reason": None, "stages": stages}
    handlers = {}
    driver: Driver | None = None
    provider = None  # None: the local provider (loopback); else e.g. NetnsProvider

    def interrupted(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        handlers[sig] = signal.signal(sig, interrupted)
    try:
        model = args.model
        if args.stub:
            from ..pipeline.stub import stub_checkpoint

            model = str(stub_checkpoint())
        elif model is None:
            from ..pipeline.checkpoint import init_checkpoint

            progress.update("writing a small checkpoint")
            model = str(tmp / "model")
            init_checkpoint(model, "small", seed=0)
        names = ["orchestrator", *(f"stage-{k}" for k in range(stages))]
        if args.provider == "netns":
            from .netns import NetnsError, NetnsProvider

            progress.update("building the netns testbed")
            try:
                provider = NetnsProvider(["relay", *names])
                net_specs = [s for s in args.fault if provider.handles(s)]
                plan = plan_faults([s for s in args.fault if not provider.handles(s)], stages,
                                   provider.addresses())
                provider.setup(net_specs)  # validates the specs before building anything
            except (NetnsError, ValueError) as exc:
                raise SmokeError("error", str(exc)) from None
            result["testbed"] = provider.describe()
            every = provider.addresses()
            relay_bind = every["relay"]
            addrs = {n: every[n] for n in names}
        else:
            ports = free_ports(len(names) + 1)
            relay_bind = f"127.0.0.1:{ports[0]}"
            addrs = {n: f"127.0.0.1:{p}" for n, p in zip(names, ports[1:], strict=True)}
            try:
                plan = plan_faults(args.fault, stages, {**addrs, "relay": relay_bind})
            except ValueError as exc:
                raise SmokeError("error", str(exc)) from None

        from .env import prepare_env
        from .model import new_run
        from .state import default_run_dir, next_run_name

        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        run = new_run(next_run_name(run_dir), stages, now=time.time(), relay=True,
                      startup_order=args.startup_order, stop_criteria=args.stop_criteria)
        result["run"] = run.name
        relay_url = f"ws://{relay_bind}"
        common = ["--stages", str(stages), "--relay", relay_url, "--model", model, "--profile", "local",
                  "--snapshot-dir", str(tmp / "snapshots"), "--snapshot-interval", "1"]
        argvs = {"relay": ["relay", "--bind", relay_bind]}
        for name in names:
            role = ["--role", "orchestrator"] if name == "orchestrator" else ["--role", "stage", "--stage",
                                                                                name.split("-")[1]]
            seeds = [f"--seed={addrs[n]}" for n in names if n != name]
            faults = [f"--fault={f}" for f in plan.node_faults.get(name, [])]
            dashboard = provider.dashboard_bind(name) if provider else "127.0.0.1:0"
            argvs[name] = ["run", *role, "--bind", addrs[name], "--dashboard", dashboard,
                           *seeds, *faults, *common]
        driver = Driver(run, run_dir, argvs, prepare_env(run, run_dir, addrs), progress,
                        spawn=provider.spawn if provider else LocalProcess)
        driver.observe()
        driver.wait_started(["relay", *names], args.timeout)
        by_name = driver.procs
        procs = list(by_name.values())
        urls = {name: _dashboard(by_name[name], 30) for name in names}
        prefixes = {by_name[n].boot.prefix: n for n in names}

        progress.update("converging")
        t_conv = time.monotonic()
        want = ["pp-entry", "pp-exit", *(f"pp-stage-{k}" for k in range(stages)), "pp-orchestrator"]
        with httpx.Client(timeout=10) as client:
            deadline = t_conv + args.timeout
            while True:
                snaps = {n: _snapshot(client, urls[n]) for n in names}
                live = all(sum(m["state"] == "alive" for m in s["members"]) == stages for s in snaps.values())
                # Every direction probed at least once, so the paths reported are measured, not assumed.
                probed = all(m["path_checks"] > 0 for s in snaps.values() for m in s["members"])
                orch_names = snaps["orchestrator"]["names"]
                if live and probed and all(orch_names.get(n, {}).get("resolves") for n in want):
                    break
                for p in procs:
                    if not p.alive():
                        raise SmokeError(f"exited ({p.proc.returncode})",
                                         f"{p.name} exited while converging: {p.lines[-3:]}")
                if time.monotonic() > deadline:
                    missing = [n for n in want if not orch_names.get(n, {}).get("resolves")]
                    cut_off = _cut_off(snaps, prefixes)
                    raise SmokeError(f"unreachable: {', '.join(cut_off)}" if cut_off else "timeout",
                                     f"not converged within {args.timeout:g}s; "
                                     f"unresolved: {', '.join(missing) or 'none'}")
                time.sleep(0.2)
            converge_s = time.monotonic() - t_conv
            progress.log(f"converged in {converge_s:.1f}s: "
                         + " ".join(f"{p}={n}" for p, n in prefixes.items()))

            if plan.relay_down_s is not None:
                relay = by_name["relay"]
                threading.Timer(plan.relay_down_s, lambda: relay.signal(signal.SIGKILL)).start()
            progress.update("generating")
            tokens, first_token_s, t_gen = [], None, time.monotonic()
            body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "stream": True}
            with client.stream("POST", f"{urls['orchestrator'].url}/v1/completions", json=body,
                               headers=urls["orchestrator"].headers,
                               timeout=httpx.Timeout(args.timeout, connect=10)) as r:
                if r.status_code != 200:
                    r.read()
                    raise SmokeError("error", f"orchestrator answered {r.status_code}: {r.text}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        message = chunk["error"]
                        if message.startswith("lost: "):
                            raise SmokeError(message, "lost")
                        raise SmokeError("error", message)
                    extra = chunk.get("meshd")
                    if extra is not None:
                        tokens.append(extra["token"])
                        first_token_s = first_token_s or time.monotonic() - t_gen
                        rate = len(tokens) / max(time.monotonic() - t_gen, 1e-9)
                        progress.update(f"generating: {len(tokens)}/{args.max_tokens} tokens, "
                                        f"{rate:.1f} tokens/s")
                        for who, at in plan.kills:
                            if len(tokens) == at and by_name[who].alive():
                                by_name[who].signal(signal.SIGKILL)
                                progress.log(f"killed {who} (SIGKILL) after token {at}")
            gen_s = time.monotonic() - t_gen
            final = {n: _snapshot(client, urls[n]) for n in names if by_name[n].alive()}

        progress.update("checking against meshd generate")
        ref = generate(model, args.prompt, args.max_tokens)
        from ..pipeline.config import LlamaConfig
        from ..pipeline.tokenizer import load_tokenizer

        config = LlamaConfig.load(model)
        text = load_tokenizer(model, config.bos_token_id, config.eos_token_ids).decode(tokens)
        paths, asymmetric = _paths(final, prefixes)
        matches = tokens == ref["tokens"]
        if not matches:
            _record_failure(driver, SmokeError("failed", "output differs from meshd generate"))
        result.update({
            "ok": matches,
            "status": "done" if matches else "failed",
            "reason": None if matches else "output differs from meshd generate",
            "tokens": tokens, "text": text, "reference_tokens": ref["tokens"], "matches_reference": matches,
            "stage_map": prefixes, "paths": paths, "asymmetric": asymmetric,
            "timings": {"converge_s": round(converge_s, 3),
                        "first_token_s": None if first_token_s is None else round(first_token_s, 3),
                        "tokens_per_s": round(len(tokens) / gen_s, 2) if gen_s > 0 else None,
                        "total_s": None},
        })
    except SmokeError as exc:
        result.update(status=exc.status, reason=exc.reason)
        _record_failure(driver, exc)
    except Interrupted as exc:
        result.update(status="stopped", reason=f"interrupted by {exc}")
        if driver is not None:
            from .model import RunReason, StopRun

            driver.observe(StopRun(RunReason.INTERRUPTED))
    except (TimeoutError, RuntimeError, OSError) as exc:
        result.update(status="error", reason=str(exc))
        _record_failure(driver, SmokeError("error", str(exc)))
    finally:
        progress.update("tearing down")
        leftovers = driver.finish() if driver is not None else stop_all(procs)
        if provider is not None:
            for sig in handlers:  # a second ^C must not leave half a testbed behind
                signal.signal(sig, signal.SIG_IGN)
            leftovers += provider.teardown()
        shutil.rmtree(tmp, ignore_errors=True)
        leftovers += int(tmp.exists())
        for sig, old in handlers.items():
            signal.signal(sig, old)
        progress.stop()
    result["leftovers"] = leftovers
    if driver is not None:
        from .model import job_status_message

        result["run_status"] = str(driver.run.status)
        result["jobs"] = {j.name: job_status_message(j) for j in driver.run.jobs}
    result["ok"] = bool(result["ok"]) and leftovers == 0
    if "timings" in result:
        result["timings"]["total_s"] = round(time.monotonic() - t_start, 3)
    if not args.json:
        _summary(result)
    if args.json:
        print(json.dumps(result), flush=True)
    if result["status"] == "stopped":
        return 130
    return 0 if result["ok"] else 1


def _cut_off(snaps: dict[str, dict], prefixes: dict[str, str]) -> list[str]:
    """Nodes that most of the others do not see alive (e.g. an isolated one), by run name."""
    names = list(snaps)
    seen = {n: 0 for n in names}
    for snap in snaps.values():
        for m in snap["members"]:
            other = prefixes.get(m["prefix"])
            if other in seen and m["state"] == "alive":
                seen[other] += 1
    return [n for n in names if seen[n] * 2 < len(names) - 1]


def _record_failure(driver: Driver | None, exc: SmokeError) -> None:
    """Tell the run model what went wrong, so statuses and `meshd ps` say it."""
    if driver is None:
        return
    from .model import Lost, RunReason, StopRun

    m = re.match(r"^lost: (?P<job>[\w-]+) \((?P<detail>.*)\)$", exc.status)
    if m and m["job"] in driver.procs:
        driver.observe(Lost(m["job"], m["detail"]))
    else:
        driver.observe(StopRun(RunReason.STOPPED_BY_USER))


def _paths(snaps: dict[str, dict], prefixes: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """Each ordered pair's path, from each node's own outbound view; and the asymmetric pairs."""
    table: dict[tuple[str, str], dict] = {}
    for name, snap in snaps.items():
        for m in snap["members"]:
            other = prefixes.get(m["prefix"])
            if other is None:
                continue
            table[(name, other)] = m
    paths = [{"from": a, "to": b, "path": "relay" if _uses_relay(m) else m["path_out"],
              "datagrams": m["path_out"], "data": m.get("data_out"),
              "rtt_ms": m.get("rtt_ms"), "why": m.get("last_failure"), "relay_ok": m.get("relay_ok"),
              "direct_failures": m.get("direct_failures")}
             for (a, b), m in sorted(table.items())]
    asymmetric = []
    for (a, b), m in sorted(table.items()):
        back = table.get((b, a))
        if back is None or a > b:
            continue
        if m["path_out"] != back["path_out"] or _uses_relay(m) != _uses_relay(back):
            asymmetric.append({"from": a, "to": b, "detail": f"{_side(a, b, m)}; {_side(b, a, back)}"})
    return paths, asymmetric


def _uses_relay(m: dict) -> bool:
    """Either layer of this direction (datagrams, or the data stream) goes via the relay."""
    return "relay" in (m["path_out"], m.get("data_out"))


def _side(a: str, b: str, m: dict) -> str:
    """One direction in a line: ``stage-2→stage-0: relay (why)`` or ``…: direct, 0.4 ms``."""
    if not _uses_relay(m):
        rtt = f", {m['rtt_ms']:.1f} ms" if m.get("rtt_ms") is not None else ""
        return f"{a}→{b}: direct{rtt}"
    why = m.get("data_last_failure") if m.get("data_out") == "relay" else None
    why = why or m.get("last_failure")
    layer = "" if m["path_out"] == "relay" else " (data; datagrams direct)"
    return f"{a}→{b}: relay{layer}" + (f", because {why}" if why else "")


def _summary(result: dict) -> None:
    out = sys.stdout
    reason = f" ({result['reason']})" if result.get("reason") else ""
    print(f"smoke-run: {result['status']}{reason}", file=out)
    if result.get("stage_map"):
        print("stage map: " + " ".join(f"{p}={n}" for p, n in result["stage_map"].items()), file=out)
    for a in result.get("asymmetric", []):
        print(f"asymmetric: {a['detail']}", file=out)
    relayed = [f"{p['from']}→{p['to']}" for p in result.get("paths", []) if p["path"] != "direct"]
    if result.get("paths"):
        print(f"paths: {len(result['paths']) - len(relayed)} direct" +
              (f", via relay: {', '.join(relayed)}" if relayed else ""), file=out)
    if "tokens" in result:
        t = result["timings"]
        print(f"generated {len(result['tokens'])} tokens; matches meshd generate: "
              f"{'yes' if result['matches_reference'] else 'NO'}", file=out)
        print(f"converge {t['converge_s']}s, first token {t['first_token_s']}s, {t['tokens_per_s']} tokens/s",
              file=out)
    print(f"leftovers: {result['leftovers']}", file=out)


def add_parser(sub) -> None:
    p = sub.add_parser("smoke-run", help="relay, orchestrator, N stages: one generation, checked, torn down",
                       description="Start a relay, an orchestrator and N stage nodes on loopback, generate, "
                                   "compare with `meshd generate` token for token, and tear everything down. "
                                   "Exit 0 only if the run passed.")
    p.add_argument("--stages", type=_stages, required=True, metavar="N")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="DIR", help="checkpoint (default: a `small` one in a temp dir)")
    model.add_argument("--stub", action="store_true", help="the tiny built-in model")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=_positive_int, default=32, metavar="K")
    p.add_argument("--provider", choices=["local", "netns"], default="local",
                   help="local: loopback processes; netns: a namespace per node, faults as nftables/tc "
                        "(root only)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="drop:A->B, isolate:X, loss:P, delay:MS, kill:X@token-T, relay-down@SECONDS, "
                        "nat:X (netns)")
    p.add_argument("--startup-order", choices=["any", "master-first", "workers-first"], default="any")
    p.add_argument("--stop-criteria", choices=["all-done", "master-done"], default="master-done")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="for convergence and generation")
    p.add_argument("--run-dir", metavar="DIR", help="where run state is kept")
    p.add_argument("--json", action="store_true", help="end with one JSON object on stdout")
    p.set_defaults(func=lambda args, parser: run_smoke(args))


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _stages(text: str) -> int:
    import argparse

    value = _positive_int(text)
    if value > 16:
        raise argparse.ArgumentTypeError("at most 16 stages on one machine")
    return value
