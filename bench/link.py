"""End-to-end generation over a shaped link: tether's edge drafting (MoA, EAGLE) vs server-only streaming, and what
a resync costs after an outage.

Everything on this machine: a server per drafter, tether-netsim in front of it, the edge client behind it.
For each RTT in `--rtt-ms` (one-way latency RTT/2 each way) and each bandwidth in `--mbps`:
- MoA and EAGLE: `--new-tokens` tokens greedy through draft rounds (k=`--k`, lossless delta codec; `--codec int8`
  for the lossy one); tokens/s end to end (open to last token) and payload bytes per token (up + down, KV
  deltas included), and wire bytes per token as netsim counted them (HTTP/2 and gRPC framing included);
- server-only: the target decodes on the server and streams each token (no drafting on the edge).
Then outages: with the default MoA drafter at `--outage-rtt-ms` / `--outage-mbps`, the client generating at a
reader's pace (`--pace` tokens/s), the link is cut for each of `--outages-s` seconds; reported: the offline
tokens written meanwhile, the resync's duration (request to next verified token) and its bytes each way.
Pairing (the one-off weight download) happens before shaping and is not counted.
Prints a table, then one JSON line; `--plot FILE` draws tokens/s against RTT.

    python bench/link.py                                   # the full grid (a few minutes on 2 CPU cores)
    python bench/link.py --rtt-ms 10 --mbps 100 --outages-s 1 --new-tokens 32      # a quick look
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tether.client.session import ClientConfig, EdgeSession, generate_server_only
from tether.netsim.proxy import NetSimThread
from tether.server.generate import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.service import ServiceConfig, TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "import json\n\n\ndef load_settings(path):\n    "


class Rig:
    """One server (with one drafter) behind netsim; the link is reshaped between measurements."""

    def __init__(self, target, tok, drafter_dir: Path):
        drafter = load_drafter(drafter_dir, target)
        self.tok = tok
        self.service = TetherService(target, drafter, tok, ServiceConfig(max_new_tokens=2048),
                                     model_fingerprint=fingerprint(default_model_dir()))  # fmt: skip
        self.server, port = make_server(self.service, "127.0.0.1:0")
        self.server.start()
        self.sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
        self.sim.start()
        self.cache = tempfile.TemporaryDirectory()

    def config(self, **kw) -> ClientConfig:
        base = dict(server=self.sim.address, cache_dir=self.cache.name, round_timeout_s=10.0, connect_timeout_s=30.0,
                    backoff_initial_s=0.05, backoff_max_s=0.5)  # fmt: skip
        return ClientConfig(**{**base, **kw})

    def shape(self, rtt_ms: float, mbps: float) -> None:
        self.sim.set_link(latency_ms=rtt_ms / 2, jitter_ms=0, bandwidth_kbps=mbps * 1000)

    def pair(self) -> None:
        self.shape(0, 0)
        EdgeSession(self.config()).pair()  # fills the weight cache

    def wire(self) -> int:
        s = self.sim.stats()
        return s.up_bytes + s.down_bytes

    def close(self) -> None:
        self.sim.stop()
        self.server.stop(None)
        self.cache.cleanup()


def run_drafted(rig: Rig, n: int, k: int, codec: str) -> dict:
    session = EdgeSession(rig.config(max_new_tokens=n, k=k, codec=codec))
    try:
        session.pair()
        w0 = rig.wire()
        t0 = time.monotonic()
        result = session.run(PROMPT)
        wall = time.monotonic() - t0
        wire = rig.wire() - w0
    finally:
        session.close()
    s = result.stats
    m = len(result.token_ids)
    return {"tokens": m, "tok_s": m / wall, "payload_B_per_tok": (s.bytes_up + s.bytes_down) / m,
            "wire_B_per_tok": wire / m, "tau": s.tau}  # fmt: skip


def run_server_only(rig: Rig, n: int) -> dict:
    w0 = rig.wire()
    t0 = time.monotonic()
    result = generate_server_only(rig.config(max_new_tokens=n), PROMPT, rig.tok)
    wall = time.monotonic() - t0
    m = len(result.token_ids)
    s = result.stats
    return {"tokens": m, "tok_s": m / wall, "payload_B_per_tok": (s.bytes_up + s.bytes_down) / m,
            "wire_B_per_tok": (rig.wire() - w0) / m, "tau": 1.0}  # fmt: skip


def run_outage(rig: Rig, outage_s: float, pace: float, codec: str) -> dict:
    """Generate at `pace`; after 2 s online, cut the link for `outage_s`; measure the resync that follows."""
    n = int(pace * (outage_s + 5))
    session = EdgeSession(rig.config(max_new_tokens=n, pace_tokens_per_s=pace, codec=codec, round_timeout_s=1.0))
    session.pair()

    def cutter():
        while len(session.tokens) < 2 * pace:
            time.sleep(0.01)
        rig.sim.cut()
        time.sleep(outage_s)
        rig.sim.restore()

    t = threading.Thread(target=cutter, daemon=True)
    t.start()
    try:
        result = session.run(PROMPT)
    finally:
        t.join(outage_s + 60)
        session.close()
    s = result.stats
    up, down = s.resync_bytes[0] if s.resync_bytes else (0, 0)
    return {"outage_s": outage_s, "offline_tokens": s.offline_tokens, "resync_ms": 1000 * s.resync_s[0],
            "resync_up_B": up, "resync_down_B": down, "resyncs": s.resyncs}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[10, 50, 150])
    ap.add_argument("--mbps", type=float, nargs="+", default=[1, 10, 100])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--codec", default="lossless", choices=("lossless", "int8"))
    ap.add_argument("--drafters", nargs="+", default=["drafter", "drafter-eagle"], help="under deploy/models")
    ap.add_argument("--outages-s", type=float, nargs="*", default=[5, 30])
    ap.add_argument("--outage-rtt-ms", type=float, default=50)
    ap.add_argument("--outage-mbps", type=float, default=10)
    ap.add_argument("--pace", type=float, default=20.0, help="tokens/s the client writes at during the outage runs")
    ap.add_argument("--plot", type=Path, default=None, help="write tokens/s vs RTT here (PNG)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, tok = load(default_model_dir(), "cpu")
    rows, outages = [], []
    for i, name in enumerate(args.drafters):
        rig = Rig(target, tok, ROOT / "deploy/models" / name)
        try:
            rig.pair()
            kind = json.loads((ROOT / "deploy/models" / name / "drafter_config.json").read_text())
            label = f"{kind['kind']}" + (f" tli{kind['tli']}" if kind["kind"] == "moa" else "")
            for rtt in args.rtt_ms:
                for mbps in args.mbps:
                    rig.shape(rtt, mbps)
                    rows.append({"mode": label, "rtt_ms": rtt, "mbps": mbps,
                                 **run_drafted(rig, args.new_tokens, args.k, args.codec)})  # fmt: skip
                    if i == 0:
                        rows.append({"mode": "server-only", "rtt_ms": rtt, "mbps": mbps,
                                     **run_server_only(rig, args.new_tokens)})  # fmt: skip
            if i == 0:
                rig.shape(args.outage_rtt_ms, args.outage_mbps)
                for o in args.outages_s:
                    outages.append(run_outage(rig, o, args.pace, args.codec))
        finally:
            rig.close()

    console = Console()
    t = Table(title=f"end to end over netsim, {args.new_tokens} tokens, greedy, k={args.k}, codec {args.codec}")
    for c in ("mode", "RTT ms", "Mbit/s", "tok/s", "payload B/tok", "wire B/tok", "tau"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["mode"], f"{r['rtt_ms']:.0f}", f"{r['mbps']:g}", f"{r['tok_s']:.1f}",
                  f"{r['payload_B_per_tok']:.0f}", f"{r['wire_B_per_tok']:.0f}", f"{r['tau']:.2f}")  # fmt: skip
    console.print(t)
    if outages:
        t = Table(title=f"resync after an outage (MoA, RTT {args.outage_rtt_ms:.0f} ms, {args.outage_mbps:g} Mbit/s, "
                        f"client at {args.pace:g} tok/s, policy keep)")  # fmt: skip
        for c in ("outage s", "offline tokens", "resync ms", "resync up B", "resync down B"):
            t.add_column(c, justify="right")
        for o in outages:
            t.add_row(f"{o['outage_s']:g}", str(o["offline_tokens"]), f"{o['resync_ms']:.0f}", f"{o['resync_up_B']:,}",
                      f"{o['resync_down_B']:,}")  # fmt: skip
        console.print(t)
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"bench": "link", "torch": torch.__version__, "new_tokens": args.new_tokens, "k": args.k,
                      "codec": args.codec, "rows": rows, "outages": outages}))  # fmt: skip
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = sorted({r["mbps"] for r in rows})
    fig, axes = plt.subplots(1, len(bands), figsize=(4 * len(bands), 3.4), sharey=True)
    for ax, mbps in zip([axes] if len(bands) == 1 else axes, bands, strict=True):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted((r["rtt_ms"], r["tok_s"]) for r in rows if r["mode"] == mode and r["mbps"] == mbps)
            ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
        ax.set_title(f"{mbps:g} Mbit/s")
        ax.set_xlabel("RTT (ms)")
        ax.grid(alpha=0.3)
    (axes if len(bands) == 1 else axes[0]).set_ylabel("tokens / s, end to end")
    (axes if len(bands) == 1 else axes[0]).legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
