"""Chapter 6's hidden tests (tools/hidden_tests/ch06.py), proven both ways on the real chapter: the official
solutions and answers written another way get full marks; the library called instead of SDPA, a variable the
notebook holds, numbers typed in and typical slips score 0 on the exercise they touch."""

import pytest
from grading_helpers import grade, proven_both_ways

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader


CH6 = "chapters/06_attention_module.ipynb"

CORRECT = {  # SDPA through a stacked tensor; the packing from NumPy; the counts by formula; float32 gains
    1: '''from torch.nn.functional import scaled_dot_product_attention as fused


def sdpa_forward(module, x, causal=False):
    qkv = torch.stack([x @ module.w_q, x @ module.w_k, x @ module.w_v])  # (3, B, n, d_k)
    drop = module.dropout if module.training else 0.0
    y = fused(*qkv[:, :, None], dropout_p=drop, is_causal=causal)  # (B, 1, n, d_k)
    return y[:, 0] @ module.w_o''',
    2: '''def identity_out_proj(layer):
    size = layer.d_model
    mha = torch.nn.MultiheadAttention(embed_dim=size, num_heads=1, bias=False, batch_first=True)
    stacked = np.concatenate([layer.w_q, layer.w_k, layer.w_v], axis=1).T  # (3 size, size)
    mha.in_proj_weight.data = torch.tensor(stacked, dtype=torch.float32)
    torch.nn.init.eye_(mha.out_proj.weight)
    return mha''',
    3: '''def layer_parameters(d_model, heads):
    per_head = d_model // heads
    return 3 * heads * d_model * per_head + heads * per_head * d_model  # W_Q, W_K, W_V, then W_O


def attention_work(n, d_model, heads):
    d_head = d_model // heads
    one_product = heads * n * n * d_head * 2  # a multiply-add counts as two operations
    return float(2 * one_product), np.int64(heads * n * n)''',
    4: '''def xavier_gains(f_in, f_out):
    variance = np.float32(2.0) / np.float32(f_in + f_out)
    return np.array([f_in, f_out], dtype=np.float32) * variance''',
}
CHEATS = {  # the module itself (its softmax, not SDPA); the chapter's own nn.MultiheadAttention; the printed counts;
    # the square matrix's gains typed in
    1: "def sdpa_forward(module, x, causal=False):\n    return module(x, causal=causal)",
    2: "def identity_out_proj(layer):\n    return mha",
    3: "def layer_parameters(d_model, heads):\n    return 2359296\n\n\n"
       "def attention_work(n, d_model, heads):\n    return 50331648, 16384 * heads",
    4: "def xavier_gains(f_in, f_out):\n    return 1.0, 1.0",
}
MISTAKES = {  # three-dimensional inputs; the weights not transposed; one head's weights; the factor 2 forgotten
    1: ("official", "(t.unsqueeze(1) for t in (q, k, v))", "(t for t in (q, k, v))"),
    2: ("official", 'torch.cat([weights["w_q"].T, weights["w_k"].T, weights["w_v"].T])',
        'torch.cat([weights["w_q"], weights["w_k"], weights["w_v"]])'),
    3: ("official", "weights_h.numel()", "weights_h[0, 0].numel()"),
    4: ("official", "variance = 2 / (f_in + f_out)", "variance = 1 / (f_in + f_out)"),
}


def test_chapter_6_modules_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH6, CORRECT, {"cheats": CHEATS, "mistakes": MISTAKES}, {
        ("cheats", 1): "PermissionError: this exercise asks you to write what lib.attention.attention does",
        ("cheats", 3): "`params_h`: not layer_parameters(d_model, heads)",
        ("mistakes", 1): "No available kernel",
    }, grade.Limits(timeout=300, cell_timeout=120))
