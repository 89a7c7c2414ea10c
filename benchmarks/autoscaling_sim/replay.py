"""One trace on the real control plane with real engines, and the simulator on the same
requests: how far apart are their replica-hours and SLO attainment?

    .venv/bin/python benchmarks/autoscaling_sim/replay.py [--trace diurnal] [--duration 600]

1. The replica the pods run is measured first: the step-time fit of ``calibrate.py`` on the
   tiny model the pods serve (CPU time, one thread), and the KV capacity and ``max_num_seqs``
   the operator's planner gives them.
2. The real run: the test cluster of ``tests/cluster`` (real API server, controller manager,
   scheduler, kwok nodes, the kubelet stand-in running the engines), the Helm chart with the
   operator deciding every ``--interval`` seconds, one CPU ``LLMDeployment`` of the tiny model
   with kvpilot's autoscaling. A client sends the trace's requests at their arrival times
   (prompts of the trace's token counts, ``max_tokens`` its answer length, ``ignore_eos``),
   each to the ready pod with the fewest requests in flight (the simulator's routing),
   streamed, and records each request's time to first token; ``spec.replicas`` is sampled
   every second for the replica-hours.
3. The simulation of the same requests with kvpilot's ``decide()`` under the same policy and
   interval, a replica model with the measured coefficients and the start-up time the real
   pods took.

The simulator gives every replica a device of its own; here every engine shares this
machine's cores (and with the control plane), which is the largest difference it cannot
model: read the TTFT columns with that in mind.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from fleet import simulate  # noqa: E402
from policies import Kvpilot  # noqa: E402
from replica import ReplicaModel  # noqa: E402
from traces import TRACES, make_trace  # noqa: E402

from kvpilot.operator.autoscaler import AutoscalingPolicy  # noqa: E402
from kvpilot.operator.spec import parse_spec  # noqa: E402

MAX_MODEL_LEN = 2048


def tiny_model(folder: pathlib.Path) -> pathlib.Path:
    """The tests' tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer."""
    import shutil

    import torch
    import transformers

    from kvpilot.engine.model_loader import resolve_model

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=MAX_MODEL_LEN, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    default = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / name, folder / name)
    return folder


def calibrate(model: pathlib.Path) -> dict[str, float]:
    """``calibrate.py``'s fit for ``model`` (seconds): step_base, per_batch_token,
    per_context_token."""
    out = subprocess.run(
        [sys.executable, str(HERE / "calibrate.py"), "--model", str(model)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    line = next(line for line in out.splitlines() if line.startswith("--step-base"))
    # A least-squares fit of a model this small can give a slightly negative slope (noise):
    # a step never gets cheaper with more work.
    values = [max(0.0, float(v)) for v in re.findall(r"--[a-z-]+ (\S+)", line)]
    return dict(zip(("step_base", "per_batch_token", "per_context_token"), values, strict=True))


class Replay:
    """Sends ``requests`` to the ready pods of ``name`` and records their TTFTs."""

    def __init__(self, kube, namespace: str, name: str, model: str, requests) -> None:
        self.kube, self.namespace, self.name, self.model = kube, namespace, name, model
        self.requests = requests
        self.in_flight: dict[str, int] = {}
        self.lock = threading.Lock()
        self.ttft: list[float | None] = [None] * len(requests)

    def ready_ips(self) -> list[str]:
        pods = self.kube.items(
            f"/api/v1/namespaces/{self.namespace}/pods",
            labelSelector=f"kvpilot.dev/llmdeployment={self.name}",
        )
        return [
            p["status"]["podIP"]
            for p in pods
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            )
            and not p["metadata"].get("deletionTimestamp")
        ]

    def send(self, index: int, start: float, ips: list[str]) -> None:
        request = self.requests[index]
        arrival = start + request.arrival
        while not ips:  # no replica ready (scaled to zero or all starting): held, as the sim holds
            time.sleep(0.2)
            ips = self.ready_ips()
        with self.lock:
            ip = min(ips, key=lambda a: self.in_flight.get(a, 0))
            self.in_flight[ip] = self.in_flight.get(ip, 0) + 1
        rng = random.Random(index)
        body = json.dumps({
            "model": self.model, "stream": True, "ignore_eos": True, "temperature": 0,
            "prompt": [rng.randrange(100, 49000) for _ in range(request.prompt_tokens)],
            "max_tokens": request.output_tokens,
        }).encode()  # fmt: skip
        try:
            answer = urllib.request.urlopen(
                urllib.request.Request(
                    f"http://{ip}:8000/v1/completions", data=body,
                    headers={"Content-Type": "application/json"},
                ),
                timeout=600,
            )  # fmt: skip
            for line in answer:
                if line.startswith(b"data: ") and b'"text"' in line:
                    self.ttft[index] = time.monotonic() - arrival
                    break
            answer.read()
        except OSError:
            pass
        finally:
            with self.lock:
                self.in_flight[ip] -= 1

    def run(self) -> None:
        start = time.monotonic()
        threads, ips, refreshed = [], self.ready_ips(), start
        for index, request in enumerate(self.requests):
            delay = start + request.arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() - refreshed > 1.0:
                ips, refreshed = self.ready_ips(), time.monotonic()
            thread = threading.Thread(target=self.send, args=(index, start, list(ips)), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(900)


def real_run(args, spec: dict, model_dir: pathlib.Path, requests) -> tuple[list, float, int, float]:
    """(TTFTs, replica-seconds, peak replicas, start-up seconds of a pod) of the real run."""
    from tests.cluster import CHART, Cluster, wait_for

    with tempfile.TemporaryDirectory(prefix="kvpilot-replay-") as work:
        kube = Cluster(pathlib.Path(work)).start()
        try:
            kube.install_crd()
            namespace = kube.create_namespace("replay")
            kube.helm(
                "install", "kvp", str(CHART), "--namespace", namespace, "--wait",
                "--set", "crds.install=false",
                "--set-json", f'operator.watchNamespaces=["{namespace}"]',
                "--set-json", f'operator.extraArgs=["--autoscale-interval={args.interval:g}"]',
            )  # fmt: skip
            kube.create_llmd(namespace, "replay", spec)
            replay = Replay(kube, namespace, "replay", str(model_dir), requests)
            wait_for(lambda: replay.ready_ips(), "the first engine", timeout=600)
            samples: list[int] = []
            stop = threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    samples.append(kube.llmd(namespace, "replay")["spec"]["replicas"])
                    stop.wait(1.0)

            sampler = threading.Thread(target=sample, daemon=True)
            print(
                f"replaying {len(requests)} requests over {args.duration:g} s ...", file=sys.stderr
            )
            sampler.start()
            replay.run()
            stop.set()
            sampler.join()
            startups = []
            engines = kube.items(
                f"/api/v1/namespaces/{namespace}/pods",
                labelSelector="kvpilot.dev/llmdeployment=replay",
            )
            for pod in engines:
                ready = next(
                    (c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"), {}
                )
                if ready.get("status") == "True":
                    created = pod["metadata"]["creationTimestamp"]
                    startups.append(_seconds(ready["lastTransitionTime"]) - _seconds(created))
            startup = max(startups) if startups else 10.0
            seconds = sum(samples[: int(args.duration)])
            return replay.ttft, seconds, max(samples, default=0), startup
        finally:
            kube.stop()


def _seconds(stamp: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="diurnal", choices=TRACES)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds")
    parser.add_argument("--rate", type=float, default=2.0, help="mean requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo", type=float, default=2.0, help="TTFT SLO, seconds")
    parser.add_argument("--interval", type=float, default=5.0, help="autoscaling interval, s")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="sequence slots per engine")
    args = parser.parse_args(argv)

    autoscaling = {
        "minReplicas": 1, "maxReplicas": args.max_replicas, "stableWindowSeconds": 30,
        "panicWindowSeconds": 6, "scaleDownStabilizationSeconds": 60,
    }  # fmt: skip
    from kvpilot.engine.model_loader.resolve import get_cache_dir

    # Outside /tmp: a pod's /tmp is a volume of its own (tests/cluster/fixtures.py says why).
    model_dir = get_cache_dir() / "test-models" / "replay-tiny-llama"
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        tiny_model(model_dir)
    coefficients = calibrate(model_dir)
    spec = {
        "model": {"source": f"file://{model_dir}"},
        "engine": {"maxModelLen": MAX_MODEL_LEN, "maxNumSeqs": args.max_num_seqs},
        "resources": {"requests": {"cpu": "100m", "memory": "1600Mi"}, "limits": {"memory": "1600Mi"}},
        "autoscaling": autoscaling,
    }  # fmt: skip
    from kvpilot.engine.model_shape import ModelShape
    from kvpilot.operator.planner import plan_for_spec

    parsed = parse_spec(spec)
    planned = plan_for_spec(
        parsed, ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    )
    requests = make_trace(
        args.trace,
        duration=args.duration,
        rate=args.rate,
        seed=args.seed,
        max_model_len=MAX_MODEL_LEN,
    )
    ttfts, replica_seconds, peak, startup = real_run(args, spec, model_dir, requests)

    policy = AutoscalingPolicy.from_spec(parsed.autoscaling)
    sim_model = ReplicaModel(
        kv_capacity_tokens=planned.kv_capacity_tokens, max_num_seqs=planned.max_num_seqs,
        max_num_batched_tokens=planned.max_num_batched_tokens, startup_seconds=startup, **coefficients,
    )  # fmt: skip
    sim_requests = make_trace(
        args.trace,
        duration=args.duration,
        rate=args.rate,
        seed=args.seed,
        max_model_len=MAX_MODEL_LEN,
    )
    kvpilot = Kvpilot(policy, planned.max_num_seqs, startup, interval=args.interval)
    result = simulate(args.trace, sim_requests, kvpilot, sim_model, duration=args.duration)

    def attainment(values) -> float:
        return sum(1 for v in values if v is not None and v <= args.slo) / len(values)

    def quantile(values, q) -> float:
        ordered = sorted(v if v is not None else math.inf for v in values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    sim_ttfts = [r.ttft for r in result.requests]
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {platform.platform()}, {platform.processor() or 'cpu'}")
    print(
        f"trace: {args.trace}, {args.duration:g} s, rate {args.rate:g}/s, seed {args.seed}: {len(requests)} requests; SLO TTFT <= {args.slo:g} s"
    )
    print(
        f"replica: tiny Llama on CPU, max_num_seqs {planned.max_num_seqs}, KV {planned.kv_capacity_tokens} tokens; "
        f"step {coefficients['step_base'] * 1e3:.2f} ms + {coefficients['per_batch_token'] * 1e6:.1f} us/token + "
        f"{coefficients['per_context_token'] * 1e6:.3f} us/cached token (calibrate.py); start-up {startup:.1f} s (measured)"
    )
    print(f"policy: kvpilot, every {args.interval:g} s, {autoscaling}\n")
    print("| run | TTFT <= SLO | TTFT p50 (s) | TTFT p99 (s) | replica-hours | peak replicas |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, values, hours, top in (
        ("real control plane, real engines", ttfts, replica_seconds / 3600, peak),
        ("simulator", sim_ttfts, result.replica_hours, result.peak_replicas),
    ):
        p99 = quantile(values, 0.99)
        print(
            f"| {label} | {attainment(values):.1%} | {quantile(values, 0.5):.2f} | "
            f"{'unserved' if p99 == math.inf else f'{p99:.2f}'} | {hours:.4f} | {top} |"
        )
    hours_gap = (result.replica_hours - replica_seconds / 3600) / max(replica_seconds / 3600, 1e-9)
    print(
        f"\nsimulator - real: replica-hours {hours_gap:+.0%}, SLO attainment "
        f"{(attainment(sim_ttfts) - attainment(ttfts)) * 100:+.1f} points"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
