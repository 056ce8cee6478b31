"""Three decode calls (softmax, B 8, 32 query heads over 8 kv heads, D 128, L = $L keys) for
Nsight Compute: tools/ncu_summary.sh decode decode_split_kernel -- python3 bench/profile_decode.py"""
import os, sys, torch
sys.path.insert(0, "python")
import winnow
L = int(os.environ.get("L", "32768"))
q = torch.randn(8, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(8, L, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
for _ in range(3):
    torch.ops.winnow.softmax_attention_forward(q, k, v)
torch.cuda.synchronize()
