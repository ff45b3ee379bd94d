import time
import torch
from kvhive.models import load_model
from kvhive.api import make_cache
torch.manual_seed(0)
for name in ["gemma-3-270m", "qwen2.5-0.5b"]:
    model, tok = load_model(name)
    ids = torch.randint(1000, 20000, (1, 560))
    res = []
    for rep in range(2):
        c0, w0 = time.process_time(), time.perf_counter()
        with torch.no_grad():
            cache = make_cache(model, "snapkv", 0.5)
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            p1 = time.process_time()
            for _ in range(16):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        res.append((round(p1 - c0, 2), round(time.process_time() - p1, 2), round(time.perf_counter() - w0, 2)))
    print(name, "cpu prefill s, cpu 16 decode s, wall s:", res, flush=True)
    del model
