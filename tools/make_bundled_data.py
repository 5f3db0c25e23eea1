"""Writes the bundled training data of testdata/: a small world of facts as plain text (for
pretraining the bundled base model), the same facts as chat conversations (for the out-of-the-box
LoRA SFT), and a byte-level BPE tokenizer trained on them with a chat template.

    tools/bazel run //tools:make_bundled_data

Deterministic (seeded); rerunning rewrites the same files.
"""

from __future__ import annotations

import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Peru": "Lima", "Chile": "Santiago", "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Greece": "Athens",
    "Turkey": "Ankara", "Iran": "Tehran", "Cuba": "Havana", "Ireland": "Dublin", "Austria": "Vienna",
}
SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot",
          "lion": "roar", "snake": "hiss", "horse": "neigh", "pig": "oink", "frog": "croak", "bee": "buzz"}
COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow",
          "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown", "a cloud": "grey"}
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]

# The bundled base model (pretrained by py/flags/pretrain_glm5.flags): GLM-5's architecture, shrunk.
GLM5_BASE = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
    "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 64, "q_lora_rank": 96,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "index_topk": 64, "index_head_dim": 32,
    "index_n_heads": 4, "first_k_dense_replace": 1, "indexer_types": ["full", "shared", "full", "shared"],
    "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "float32",
}

# Qwen's pre-tokenizer split (transformers' Qwen3_5Tokenizer, and Qwen's released tokenizer.json).
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
              r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def facts(rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) pairs; the answer is also the fact's sentence."""
    out = []
    for country, city in CAPITALS.items():
        out.append((f"What is the capital of {country}?", f"The capital of {country} is {city}."))
        out.append((f"Which country has {city} as its capital?", f"{city} is the capital of {country}."))
    for animal, sound in SOUNDS.items():
        out.append((f"What does a {animal} say?", f"A {animal} says {sound}."))
    for thing, color in COLORS.items():
        out.append((f"What color is {thing}?", f"The color of {thing} is {color}."))
    for a in range(11):
        for b in range(11):
            if a + b <= 20:
                out.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}, or {NUMBERS[a + b]}."))
    rng.shuffle(out)
    return out


def main(root: str) -> None:
    rng = random.Random(0)
    qa = facts(rng)
    os.makedirs(root, exist_ok=True)
    # Pretraining text: paragraphs of facts.
    text_lines = []
    for _ in range(1500):
        sentences = [a for _, a in rng.sample(qa, rng.randint(3, 8))]
        text_lines.append(" ".join(sentences))
    with open(os.path.join(root, "pretrain.jsonl"), "w") as f:
        for t in text_lines:
            f.write(json.dumps({"text": t}) + "\n")
    # Chat: one to three question/answer turns, sometimes with a system message. The eval chats ask
    # only held-out questions (whose facts the base model read in pretraining): the eval loss
    # measures whether the fine-tuning generalises, not whether it memorised its training chats.
    held_out = len(qa) // 6
    systems = ["You are a helpful assistant.", "Answer in one sentence.", "You know geography, animals and sums."]
    for name, count, pool in (("chat.jsonl", 1200, qa[held_out:]), ("chat_eval.jsonl", 100, qa[:held_out])):
        with open(os.path.join(root, name), "w") as f:
            for _ in range(count):
                messages = [{"role": "system", "content": rng.choice(systems)}] if rng.random() < 0.3 else []
                for q, a in rng.sample(pool, rng.randint(1, 3)):
                    messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                f.write(json.dumps({"messages": messages}) + "\n")
    # Tokenizers: byte-level BPE on both. The GLM-5 base's splits words as GPT-2 does; the Qwen3.5
    # base's as Qwen's own (each digit alone, NFC), since transformers builds every qwen3_5
    # tokenizer with that split whatever its tokenizer.json says.
    corpus = text_lines + [f"{q}\n{a}" for q, a in qa]
    for name, qwen in (("tokenizer", False), ("tokenizer_qwen3_5", True)):
        tok = Tokenizer(models.BPE())
        if qwen:
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus, trainer)
        vocab = tok.get_vocab_size() if not qwen else vocab  # (the GLM-5 config's: its own tokenizer's)
        tdir = os.path.join(root, name)
        os.makedirs(tdir, exist_ok=True)
        tok.save(os.path.join(tdir, "tokenizer.json"))
        with open(os.path.join(tdir, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>", "bos_token": None,
                       "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
                       "model_max_length": 4096}, f, indent=2)
    config = dict(GLM5_BASE, vocab_size=vocab)
    with open(os.path.join(root, "glm5_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    print(f"{len(text_lines)} text records, 1200 + 100 chats ({held_out} of {len(qa)} questions held out for "
          f"eval), vocab {vocab} in {root}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "testdata", "sft"))
