"""How much partial traffic would the prefill save by taking each query tile's widely shared blocks query-major? A
CPU count over the bench_prefill top-k, for judging the lever before building it. Nothing is timed.

The shipped prefill is KV-block-major: every selected (token, KV head, block) writes one partial (a bf16 O row and an
fp32 lse, 260 bytes a query head) that the combine reads back; at 32k x 64/4 that is ~17 GB, about 4 ms of the H200's
4.3 TB/s before any MMA (docs/BENCHMARKS.md). The lever counted here: cut the tokens into aligned tiles of `--tile`
tokens; a block chosen by at least `--share` of a tile's tokens is "shared" and is attended query-major by one CTA
for the whole tile (its GQA heads x tile tokens as the MMA rows, the tokens that did not choose it masked), merged on
chip into one partial a (token, KV head); every other (token, block) stays a KV-block-major edge with its own partial.

For each (tile, share) it prints, over all KV heads:
- partials a token before / after (the combine's reads and the main kernel's writes scale with them), and the
  partial bytes before / after for Hq query heads;
- the MMA of the query-major pass that the masked tokens waste, as a fraction of the useful MMA (useful = the
  selected (token, block) pairs; both counted in whole 128-key blocks, as the kernels compute them);
- the blocks a tile takes query-major.

The bench_prefill top-k (local block + up to 7 of 8 globally popular blocks + uniform picks, deduplicated and cut
to 16) keeps a popular block for 70-78% of the later tokens (32k), drawn for each token independently, so shared
blocks beyond the local one need a share threshold below 1; a real indexer's neighbouring tokens agree more, which
this top-k does not model.

    python examples/bench/shared_blocks.py                                  # 32k, 64/4 (seconds)
    python examples/bench/shared_blocks.py --tokens 131072 --tile 8 --tile 64 --share 0.5
"""

import argparse

import numpy as np

from bench_prefill import D, K, make_topk

from jax_msa.reference import PAGE_SIZE as PAGE

PARTIAL_BYTES_PER_QUERY_HEAD = 2 * D + 4  # bf16 O row + fp32 lse


def selected_pairs(ids):
    """(token, block) of every plan edge of one KV head: ids in [0, own block], duplicates once (MSA.md section 2)."""
    n = ids.shape[0]
    own = np.arange(n) // PAGE
    s = np.sort(ids, axis=1)
    first = np.ones_like(s, bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    keep = first & (s >= 0) & (s <= own[:, None])
    tok = np.broadcast_to(np.arange(n)[:, None], s.shape)[keep]
    return tok, s[keep]


def count_lever(topk, tile, share):
    """Totals over the KV heads: edges before, partials after, shared (tile, block) pairs, masked token-blocks."""
    n = topk.shape[1]
    nb = -(-n // PAGE)
    edges = partials = shared_pairs = masked = 0
    for g in range(topk.shape[0]):
        tok, blk = selected_pairs(topk[g])
        key = (tok // tile) * nb + blk
        uniq, inverse, count = np.unique(key, return_inverse=True, return_counts=True)
        tile_tokens = np.minimum(tile, n - (uniq // nb) * tile)  # the last tile may be short
        is_shared = count >= share * tile_tokens
        shared_edge = is_shared[inverse]
        # one partial a token for all its shared blocks, one an edge for the rest
        has_shared = np.zeros(n, bool)
        has_shared[tok[shared_edge]] = True
        edges += tok.size
        partials += int(has_shared.sum()) + int((~shared_edge).sum())
        shared_pairs += int(is_shared.sum())
        masked += int((tile_tokens[is_shared] - count[is_shared]).sum())
    return edges, partials, shared_pairs, masked


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", default="64/4", help="Hq/Hkv")
    ap.add_argument("--tile", type=int, action="append", help="tokens a query tile (default 8, 16, 64, 128)")
    ap.add_argument("--share", type=float, action="append",
                    help="least fraction of a tile's tokens that makes a block shared (default 1, 0.75, 0.5)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    tiles = args.tile or [8, 16, 64, 128]
    shares = args.share or [1.0, 0.75, 0.5]
    topk = make_topk(np.random.default_rng(args.seed), args.tokens, hkv)
    assert topk.shape[2] == K
    tokens = args.tokens * hkv  # (token, KV head) pairs
    gb = PARTIAL_BYTES_PER_QUERY_HEAD * (hq // hkv) / 1e9
    print(f"N = {args.tokens}, heads {hq}/{hkv}, bench_prefill top-k (seed {args.seed}); partial GB = written "
          f"once + read once")
    print("| tile | share | partials a token: before -> after | partial GB (write + read) | cut | shared blocks "
          "a tile | masked MMA (of useful) |")
    print("|---|---|---|---|---|---|---|")
    for tile in tiles:
        for share in shares:
            edges, partials, shared_pairs, masked = count_lever(topk, tile, share)
            n_tiles = hkv * -(-args.tokens // tile)
            print(f"| {tile} | {share:g} | {edges / tokens:.2f} -> {partials / tokens:.2f} | "
                  f"{2 * edges * gb:.1f} -> {2 * partials * gb:.1f} | {1 - partials / edges:.1%} | "
                  f"{shared_pairs / n_tiles:.2f} | {masked / edges:.1%} |")


if __name__ == "__main__":
    main()
