"""Hugging Face generation with a static KV cache and CUDA graphs (tests/gpu/test_gpu_compat.py).

    hf_generate.py REPEATS

A small Llama built from a config (no download, weights seeded on the CPU so that every run has the same ones),
greedy generation of 48 tokens for a batch of 8 prompts with cache_implementation="static" and the forward
pass compiled by generate() with mode="reduce-overhead" (CUDA graphs), REPEATS times after a warm-up. Prints one
JSON line: the tokens of the first generation, tokens/s over the repeats, the wall time, and the memory (what the
device reports as its total, PyTorch's peak reservation).
"""
import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

repeats = int(sys.argv[1])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512)
model = LlamaForCausalLM(config).eval()
model = model.to("cuda", dtype=torch.float16)
model.generation_config.cache_implementation = "static"
model.generation_config.pad_token_id = 0
# generate() compiles the decoding forward itself when the cache is static (transformers' automatic compilation,
# which also marks each CUDA-graph step: a forward compiled by hand with mode="reduce-overhead" overwrote its
# own outputs while the cache still used them); ask for CUDA graphs explicitly
try:
    from transformers import CompileConfig
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
except ImportError:     # older transformers: the same by hand, one step per call
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def forward(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)
    model.forward = forward
prompts = torch.randint(1, 4096, (8, 32), generator=torch.Generator().manual_seed(1)).cuda()
kw = dict(max_new_tokens=48, do_sample=False, min_new_tokens=48)
with torch.no_grad():
    first = model.generate(prompts, **kw)           # compiles and captures
    model.generate(prompts, **kw)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(repeats):
        out = model.generate(prompts, **kw)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
same = bool(torch.equal(out, first))
print(json.dumps({"tokens": first[:, 32:].tolist(), "repeat_identical": same,
                  "tokens_per_s": repeats * 8 * 48 / elapsed, "seconds": elapsed,
                  "device_total": torch.cuda.mem_get_info()[1],
                  "peak_reserved": torch.cuda.max_memory_reserved()}), flush=True)
