"""Expected data-parallel scaling efficiency of BERT pretraining, on paper.

Model: one optimizer step = `accum` micro-steps; DDP all-reduces gradients once per optimizer step (bertrain
skips the allreduce on intermediate micro-steps with `no_sync`), bucketed so that it overlaps the backward pass
of the LAST micro-step only. Ring allreduce moves 2(N-1)/N x S bytes through each GPU's slowest link, so

    t_comm    = 2 (N-1)/N * S / B          S = gradient bytes, B = effective per-GPU bus bandwidth of the slowest hop
    t_compute = (global_batch / N) / R     R = per-GPU sequences/s
    t_overlap = 2/3 * micro_batch / R      backward share of the last micro-step (backward ~ 2x forward FLOPs)
    efficiency = t_compute / (t_compute + max(0, t_comm - t_overlap))

All inputs are stated below; change them with the command-line flags. Pure arithmetic, no GPU needed.
"""
from __future__ import annotations

import argparse

# Effective bus bandwidths (GB/s per GPU, large messages) -- nominal link speeds derated to what NCCL's
# all_reduce_perf typically reports as busbw.
#
# * NVLink: H100 SXM with NVSwitch, ~360 GB/s busbw inside a node. Across nodes, DGX-style: one 400 Gb/s
#   InfiniBand NIC per GPU; NCCL first reduce-scatters inside the node, so each GPU's NIC carries 1/8 of the
#   node's data: effective B = 8 NICs x ~40 GB/s = 320 GB/s.
# * PCIe/Ethernet: GPUs without NVLink talk through PCIe host bridges (~20 GB/s busbw); across nodes ONE 100 GbE
#   NIC per 8-GPU node (~11 GB/s after protocol overhead) carries the whole node's share: effective B = 11 GB/s.
# A latency term alpha per ring step (2(N-1) steps) is added: 3 us inside a node, 10 us across nodes.
LINKS = {
    "NVLink + 8x400 Gb/s InfiniBand": {"intra": 360.0, "inter": 320.0, "alpha_intra": 3e-6, "alpha_inter": 10e-6},
    "PCIe + 1x100 GbE per node": {"intra": 20.0, "inter": 11.0, "alpha_intra": 3e-6, "alpha_inter": 10e-6},
}

MODELS = {  # name: (parameters, global batch, micro batch, per-GPU seq/s target)
    "BERT-large phase 1 (seq 128, global 65,536)": (336_226_108, 65536, 64, 1700.0),
    "BERT-large phase 2 (seq 512, global 32,768)": (336_226_108, 32768, 16, 400.0),
    "BERT-base phase 1 (seq 128, global 65,536)": (110_106_428, 65536, 128, 5000.0),
}


def efficiency(params: int, global_batch: int, micro: int, rate: float, n: int, link: dict[str, float],
               grad_bytes: int, per_node: int = 8) -> tuple[float, float, float]:
    size = params * grad_bytes
    bw, alpha = (link["intra"], link["alpha_intra"]) if n <= per_node else (link["inter"], link["alpha_inter"])
    t_comm = (2 * (n - 1) / n * size / (bw * 1e9) + 2 * (n - 1) * alpha) if n > 1 else 0.0
    t_compute = global_batch / n / rate
    t_overlap = 2 / 3 * micro / rate
    exposed = max(0.0, t_comm - t_overlap)
    return t_compute / (t_compute + exposed), t_comm, t_compute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256])
    args = ap.parse_args()
    for mname, (params, gb, micro, rate) in MODELS.items():
        print(f"\n### {mname}: {params/1e6:.0f}M parameters, micro-batch {micro}, {rate:.0f} seq/s per GPU")
        print("| interconnect | GPUs | grads | bytes/step | t_comm ms | t_compute ms | efficiency |")
        print("|---|---|---|---|---|---|---|")
        for lname, link in LINKS.items():
            for n in args.gpus:
                for label, nbytes in (("fp32", 4), ("bf16 hook", 2)):
                    eff, tc, tp = efficiency(params, gb, micro, rate, n, link, nbytes)
                    print(f"| {lname} | {n} | {label} | {params*nbytes/1e9:.2f} GB | {tc*1e3:.0f} | {tp*1e3:.0f} | {eff*100:.0f}% |")


if __name__ == "__main__":
    main()
