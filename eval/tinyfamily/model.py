"""A small Llama (RMSNorm, RoPE, GQA, SwiGLU) in plain PyTorch, with Hugging Face key names.

The training script uses this module instead of transformers' LlamaForCausalLM so that training
needs only torch (the project venv's, as everything in eval/); the state_dict keys and
config.json it writes are those of LlamaForCausalLM, which loads them unchanged (the harness and tests check that the
two produce the same logits and KV cache). Tokenizer: one token per UTF-8 byte, EOS = 0, the
convention of tools/dump_kv.py --tokenizer bytes.
"""

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import dump_kv  # tools/dump_kv.py: one home for the safetensors I/O and the byte tokenizer

VOCAB = 256
EOS = dump_kv.ByteTokenizer.eos_token_id


# The context the members declare (config.json max_position_embeddings): the longest sequences
# they were trained on (512 bytes in runs 1-2, 448 in run 3); past it their cross-entropy rises
# above what no context at all gives (README.md, "Context"), so engines must refuse longer prompts.
DECLARED_CONTEXT = 512


def hf_config(layers, hidden, heads, kv_heads, head_dim, ffn, name,
              max_positions=DECLARED_CONTEXT):
    """The config.json of LlamaForCausalLM for these shapes."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": name,
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": EOS,
        "eos_token_id": EOS,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
        h = c["hidden_size"]
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        kk = k.repeat_interleave(group, dim=1)
        vv = v.repeat_interleave(group, dim=1)
        scores = (q @ kk.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
        out = torch.softmax(scores, dim=-1) @ vv
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, f = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, mask)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Llama(nn.Module):
    """LlamaForCausalLM's computation and parameter names, full-sequence forward only."""

    def __init__(self, config):
        super().__init__()
        self.config = dict(config)
        self.model = Body(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        d = config["head_dim"]
        inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_weights(self, seed):
        g = torch.Generator().manual_seed(seed)
        depth_scale = 1.0 / math.sqrt(2 * self.config["num_hidden_layers"])
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
                continue
            std = 0.02 * (depth_scale if name.endswith(("o_proj.weight", "down_proj.weight"))
                          else 1.0)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, ids, return_kv=False):
        t = ids.shape[1]
        pos = torch.arange(t, dtype=torch.float32, device=ids.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = torch.full((t, t), float("-inf"), device=ids.device).triu(1)
        x = self.model.embed_tokens(ids)
        kvs = []
        for layer in self.model.layers:
            x, kv = layer(x, cos, sin, mask)
            kvs.append(kv)
        logits = self.lm_head(self.model.norm(x))
        return (logits, kvs) if return_kv else logits


def save(model, directory):
    """Writes model.safetensors (float32) and config.json, as LlamaForCausalLM expects."""
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    dump_kv.write_safetensors(os.path.join(directory, "model.safetensors"), tensors,
                              {"format": "pt"})
    tmp = os.path.join(directory, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(model.config, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(directory, "config.json"))


def load(directory):
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    model = Llama(config)
    model.load_state_dict(dump_kv.read_safetensors(os.path.join(directory, "model.safetensors")))
    return model
