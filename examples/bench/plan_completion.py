"""When does each (token, KV head) receive its last partial? A CPU analysis of the sm90 prefill's item schedules, for
judging an in-kernel merge of the partials (the "last writer merges" alternative to the combine kernel). Nothing is
timed: every work item is assumed to take the same time (the kernel's items are tiles of equal MMA rows), and an
item's partials land when it ends.

One request of N new tokens, the bench_prefill top-k, the real plan (`build_prefill_plan`, "row" order). Schedules:
- "contiguous": CTA c walks items [c n / C, (c + 1) n / C), as the shipped kernel does (C = 132 SMs);
- "round-robin": the list in chunks of `--chunk` items dealt to the CTAs in turn (a sweep of the whole GPU over
  the list: the order of the branch `exp/window-order`'s ItemSchedule);
- "window W": the same plan rows re-tiled at windows of W consecutive tokens and ordered (window, head, row, tile),
  walked round-robin (that branch's "window" work order).

For each, the quantiles of the completion time (fraction of the run) over (token, KV head) pairs, and the "open span"
(last partial minus first) with the partial bytes written GPU-wide meanwhile (bf16 partials, whose reads by a merge
hit L2 only if that is well below its 50 MB).

    python examples/bench/plan_completion.py                      # 32k, 4 KV heads (about a minute)
    python examples/bench/plan_completion.py --tokens 8192 --window 1024 --window 2048
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_msa
from bench_prefill import D, make_topk

PARTIAL_ROW_BYTES = 2 * D + 4  # bf16 O row + fp32 lse


def edge_items(plan, n_items):
    """(item index, head, edge) of every edge the first n_items work items cover."""
    work = np.asarray(plan.work)[:n_items]
    counts = work[:, 3]
    item = np.repeat(np.arange(n_items), counts)
    starts = np.repeat(work[:, 2] - np.cumsum(counts) + counts, counts)
    edge = starts + np.arange(counts.sum())
    return item, work[item, 0], edge


def contiguous_times(n, ctas):
    """End time (fraction of the run) of each item when CTA c walks [c n / C, (c + 1) n / C)."""
    bounds = (np.arange(ctas + 1) * n) // ctas
    cta = np.searchsorted(bounds, np.arange(n), side="right") - 1
    pos = np.arange(n) - bounds[cta]
    return (pos + 1) / (bounds[cta + 1] - bounds[cta]).max()


def round_robin_times(n, ctas, chunk):
    """End time of each item when chunks of `chunk` items are dealt to the CTAs in turn."""
    i = np.arange(n)
    rnd, within = (i // chunk) // ctas, i % chunk
    pos = rnd * chunk + within
    return (pos + 1) / (pos.max() + 1)


def window_items(plan, window):
    """(item index a plan edge falls in, item count) after re-tiling every (head, row) at windows of `window` tokens,
    items ordered (window, head, row, tile)."""
    row_ptr, edge_query = np.asarray(plan.row_ptr), np.asarray(plan.edge_query)
    q = plan.queries_per_tile
    heads, rows = row_ptr.shape[0], row_ptr.shape[1] - 1
    g = np.repeat(np.arange(heads), row_ptr[:, -1])
    edge = np.concatenate([np.arange(row_ptr[h, -1]) for h in range(heads)])
    row = np.concatenate([np.repeat(np.arange(rows), np.diff(row_ptr[h])) for h in range(heads)])
    win = edge_query[g, edge] // window
    segment = (win * heads + g) * rows + row  # (window, head, row), ascending = the item order
    order = np.lexsort((edge, segment))
    seg_sorted = segment[order]
    first = np.searchsorted(seg_sorted, seg_sorted, side="left")
    tile = (np.arange(len(order)) - first) // q
    key = seg_sorted.astype(np.int64) * (1 << 20) + tile
    uniq, item_sorted = np.unique(key, return_inverse=True)
    item = np.empty_like(item_sorted)
    item[order] = item_sorted
    return g, edge, item, len(uniq)


def completion(heads, total_q, g, tok, t_item):
    done = np.zeros((heads, total_q))
    first = np.full((heads, total_q), np.inf)
    np.maximum.at(done, (g, tok), t_item)
    np.minimum.at(first, (g, tok), t_item)
    return done, first


def report(name, done, first, mask, partial_bytes):
    """One line: completion quantiles, and the open span with the partial bytes written GPU-wide during it."""
    d, span = done[mask], (done - first)[mask]
    qs = ", ".join(f"{x:.3f}" for x in np.quantile(d, [0.1, 0.25, 0.5, 0.75, 0.9]))
    print(f"{name:>24}: completion 10/25/50/75/90% at {qs} | open span median {np.median(span):.4f} "
          f"(p90 {np.quantile(span, 0.9):.4f}): {np.median(span) * partial_bytes / 1e6:,.0f} MB of partials written "
          "meanwhile")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="64/4", help="Hq/Hkv (Hq only scales the partial bytes)")
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--window", type=int, action="append", help="window order sizes (default 2048 and 4096)")
    args = ap.parse_args()
    n = args.tokens
    hq, hkv = (int(x) for x in args.heads.split("/"))
    topk = make_topk(np.random.default_rng(0), n, hkv)
    cu, sl = jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32)
    plan = jax.jit(lambda t: jax_msa.build_prefill_plan(t, cu, sl, max_blocks=-(-n // 128)))(jnp.asarray(topk))
    n_items = int(np.asarray(plan.num_work)[0])
    edge_query, counts = np.asarray(plan.edge_query), np.asarray(plan.query_edge_count)
    mask = counts > 0
    partial_bytes = int(counts.sum()) * (hq // hkv) * PARTIAL_ROW_BYTES
    print(f"N = {n}, heads {hq}/{hkv}: {n_items:,} items, {counts.sum() / mask.sum():.2f} partials a (token, KV head), "
          f"{partial_bytes / 1e9:.2f} GB of bf16 partials; {args.ctas} CTAs")
    item, g, edge = edge_items(plan, n_items)
    tok = edge_query[g, edge]
    for name, times in [("row, contiguous", contiguous_times(n_items, args.ctas)),
                        (f"row, round-robin {args.chunk}", round_robin_times(n_items, args.ctas, args.chunk))]:
        report(name, *completion(hkv, n, g, tok, times[item]), mask, partial_bytes)
    for window in args.window or [2048, 4096]:
        wg, wedge, witem, w_items = window_items(plan, window)
        times = round_robin_times(w_items, args.ctas, args.chunk)
        report(f"window {window} ({w_items:,})", *completion(hkv, n, wg, edge_query[wg, wedge], times[witem]), mask,
               partial_bytes)


if __name__ == "__main__":
    main()
