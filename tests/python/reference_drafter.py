"""Independent reference pieces of the drafter tests, written from the formulas."""

from reference_rope import rotate


def rms(x, weight, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def attention_kv(attn, cfg, inputs, positions):
    """(keys [kv_heads, T, head_dim] after k_norm and RoPE, values [kv_heads, T, head_dim]) of
    one drafter attention layer for `inputs` [T, hidden] at `positions`."""
    k = (inputs @ attn.k_proj.weight.T).view(len(positions), cfg.num_key_value_heads, -1)
    k = rotate(rms(k, attn.k_norm.weight, cfg.rms_norm_eps).transpose(0, 1), positions,
               cfg.rope_theta)
    v = (inputs @ attn.v_proj.weight.T).view(len(positions), cfg.num_key_value_heads, -1)
    return k, v.transpose(0, 1)
