"""Does vLLM's int4 writer leave the last rows of an odd-chunk batch wrong? Proxima's CUDA write
(vLLM's writer on slot views) of the first T tokens, unpadded and padded, against the same rows
written in a 40-token batch (an even chunk count). Run on the GPU machine: python3 odd_write.py"""
import torch

from proxima.engine.attention import per_token_head as pth

FMT = pth.PTH_FORMATS["int4_per_token_head"]
PADDER = pth._even_hadamard_chunks


def _identity(key, value, slots):
    return key, value, slots


def write(key, value, slots, n: int, tokens: int, pad: bool) -> torch.Tensor:
    pth._even_hadamard_chunks = PADDER if pad else _identity
    heads, d = key.shape[1], key.shape[2]
    raw = torch.zeros(120, 1, heads, FMT.record_bytes(d), dtype=torch.uint8, device="cuda")
    cache = pth.cache_views(raw, FMT, heads, d)
    pth.vllm_write(key[:n], value[:n], cache, slots[:n])
    return cache.rows[slots[:tokens]].cpu()


def main() -> None:
    for d, heads, tokens in ((256, 3, 37), (128, 3, 35), (64, 3, 36), (256, 1, 37), (128, 2, 37)):
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator().manual_seed(d + tokens)
            key = (torch.randn(40, heads, d, generator=g) * 3).to(dtype).cuda()
            value = (torch.randn(40, heads, d, generator=g) * 3).to(dtype).cuda()
            slots = torch.randperm(120, generator=g)[:40].cuda()
            ref = write(key, value, slots, 40, tokens, True)
            for pad in (False, True):
                rows = write(key, value, slots, tokens, tokens, pad)
                differ = (rows != ref).view(tokens, heads, -1).any(-1)
                bad = [int(r) for r in differ.nonzero()[:, 0]]
                tries = [bool((write(key, value, slots, tokens, tokens, pad) != ref).any()) for _ in range(5)]
                print(f"d{d} H{heads} T{tokens} {str(dtype)[6:]:8} pad={pad!s:5} rows differing: {bad[:6]} "
                      f"(tokens) repeats differing {sum(tries)}/5", flush=True)


if __name__ == "__main__":
    main()
