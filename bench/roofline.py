"""Roofline figures for the benchmarks: how far a decode step and an update are from what the card allows.

- decode floor (ms per step) = (weight bytes + KV bytes the step reads) / peak memory bandwidth: a decode
  step at batch sizes like ours is bound by reading every weight once plus each row's KV history.
- update floor (s) = 6 x parameters x trained tokens / peak dense bf16 FLOP/s (forward + backward; the
  recomputation of gradient checkpointing is not counted, so it shows up as lost share).
The share of each is floor / measured (1.0 = at the roof). Peaks are the spec sheets' (H100 SXM: 3.35 TB/s,
989 TFLOP/s; H200: 4.8 TB/s, 989 TFLOP/s); an unknown card uses the H100's and says so.
"""

from __future__ import annotations

PEAKS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}  # bytes/s, dense bf16 FLOP/s


def device_peaks(name: str) -> tuple[float, float, str]:
    """(bandwidth, FLOP/s, which card's spec) for a device name such as 'NVIDIA H100 80GB HBM3'."""
    for card, (bw, flops) in PEAKS.items():
        if card in name:
            return bw, flops, card
    return (*PEAKS["H100"], f"H100 (assumed for {name!r})")


def n_params(shape: dict) -> float:
    """Parameters of a Qwen2-style configuration (q, k, v with biases, o, gated MLP, norms, embeddings)."""
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    layer = h * h * 2 + 2 * h * kv + h + 2 * kv + 3 * h * i + 2 * h
    return layers * layer + v * h * (1 if shape["tie_word_embeddings"] else 2) + h


def kv_bytes_per_token(shape: dict, elem: int = 2) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * elem


def decode_floor_ms(shape: dict, rows: float, mean_context: float, bandwidth: float, elem: int = 2) -> float:
    """Milliseconds one decode step needs at full bandwidth: every weight once, plus `rows` KV histories of
    `mean_context` tokens (bf16: elem 2)."""
    return 1e3 * (n_params(shape) * elem + rows * mean_context * kv_bytes_per_token(shape, elem)) / bandwidth


def update_floor_s(shape: dict, tokens: float, flops: float) -> float:
    return 6 * n_params(shape) * tokens / flops


def roofline(shape: dict, device_name: str, *, decode_ms: float, rows: float, mean_context: float,
             update_s: float | None = None, tokens: float = 0.0) -> dict:  # fmt: skip
    """The roofline entries of a result: floors, measured values and shares (floor / measured)."""
    bw, flops, card = device_peaks(device_name)
    floor = decode_floor_ms(shape, rows, mean_context, bw)
    out = {"peaks_of": card, "decode_ms": decode_ms, "decode_floor_ms": floor, "decode_rows": rows,
           "decode_mean_context": mean_context, "decode_share": floor / decode_ms if decode_ms > 0 else 0.0}
    if update_s:
        out.update(update_s=update_s, update_floor_s=update_floor_s(shape, tokens, flops))
        out["update_share"] = out["update_floor_s"] / update_s
    return out


def roofline_line(r: dict) -> str:
    line = (f"roofline ({r['peaks_of']} peaks): decode {r['decode_ms']:.2f} ms/step vs floor {r['decode_floor_ms']:.2f} "
            f"ms ({r['decode_rows']:.0f} rows, {r['decode_mean_context']:.0f} tokens of context) = "
            f"{100 * r['decode_share']:.0f} %")
    if "update_s" in r:
        line += (f"; update {r['update_s']:.2f} s vs 6ND floor {r['update_floor_s']:.2f} s = "
                 f"{100 * r['update_share']:.0f} %")
    return line
