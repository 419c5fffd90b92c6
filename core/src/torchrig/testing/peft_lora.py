"""The LoRA workload every strategy's PEFT test trains (the core's PEFT tests, plugins/*/tests/test_*_peft.py).
Needs ``peft`` and ``transformers`` (QLoRA: ``bitsandbytes``).

A 2-layer transformers ``LlamaForCausalLM`` built from a config (no network) wrapped by peft's
``get_peft_model(LoraConfig(...))``: the base is frozen, only the adapters train. The adapters start random
(``init_lora_weights=False``) so both LoRA matrices get gradients from the first step. The same seed gives
the same weights in every process; :func:`reference` is the one-process run on the concatenated batches of
every data-parallel rank that a distributed run must equal; :func:`train` is the loop a user writes with
torchrig (accumulation, clipping on the synchronizing micro-step, the loss averaged over the ranks).
"""

from __future__ import annotations

import itertools

import peft
import torch
import transformers

VOCAB, HIDDEN, SEQ = 64, 32, 8
#: colwise (q, v) and rowwise (o) projections: the two tensor-parallel shapes a LoRA layer must follow.
TARGETS = ("q_proj", "v_proj", "o_proj")
LR, CLIP = 1e-2, 0.05


def llama_config(**overrides) -> transformers.LlamaConfig:
    arguments = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2}
    return transformers.LlamaConfig(**{**arguments, **overrides})


def lora_config(**overrides) -> peft.LoraConfig:
    arguments = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": list(TARGETS),
                 "init_lora_weights": False}
    return peft.LoraConfig(**{**arguments, **overrides})


def build(seed: int = 0, **config_overrides) -> peft.PeftModel:
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(llama_config(**config_overrides))
    return peft.get_peft_model(base, lora_config())


#: bitsandbytes' CPU 4-bit kernels need rows of at least one quantization block (64 values).
QLORA_CONFIG = {"hidden_size": 64, "intermediate_size": 128}


def save_base(directory: str, seed: int = 0) -> None:
    """The base model's weights as ``from_pretrained`` reads them (QLoRA quantizes while loading)."""
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(llama_config(**QLORA_CONFIG)).save_pretrained(directory)


def build_qlora(directory: str, seed: int = 0) -> peft.PeftModel:
    """QLoRA: the base loaded from ``directory`` quantized to 4-bit NF4 by bitsandbytes (fp32 compute),
    prepared for k-bit training, LoRA adapters on top (seeded: the same in every process)."""
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization,
                                                             device_map="cpu")
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, lora_config())
    # from_pretrained returns eval mode; a training loop sets train mode (bitsandbytes' CPU eval forward repacks the
    # 4-bit weights in place, and state_dict() unpacks them again, not bit-exactly)
    return model.train()


def make_data(samples: int, seed: int = 1234) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (samples, SEQ), generator=generator))


def adapter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def train(accelerator, model, optimizer, loader, steps: int | None = None) -> dict:
    """The user's loop; ``steps`` micro-batches at most (none fetched beyond). Returns the losses averaged over
    the ranks (equal token counts: the mean of the concatenated batch) and the pre-clip gradient norms."""
    losses, norms = [], []
    for (tokens,) in itertools.islice(loader, steps):
        with accelerator.accumulate(model):
            loss = loss_of(model, tokens)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    return {"losses": losses, "norms": norms}


def full_state(accelerator, model) -> dict[str, torch.Tensor]:
    """Every tensor of the model, whole, in fp32 (``{}`` on ranks the strategy gives nothing)."""
    state = accelerator.get_state_dict(model)
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()
            for name, t in state.items()}


def reference(samples: int, global_batch: int, accumulation: int, start: int = 0,
              stop: int | None = None, make_model=build) -> dict:
    """One process, batches of ``global_batch`` (every rank's micro-batch concatenated), the loss divided by
    the accumulation steps, clipped at :data:`CLIP` before each AdamW step. Micro-batches ``start`` to
    ``stop`` are recorded (the ones before train all the same: a resumed run's history)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(make_data(samples), batch_size=global_batch)
    losses, norms = [], []
    for index, (tokens,) in enumerate(itertools.islice(loader, stop)):
        loss = loss_of(model, tokens)
        (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
            optimizer.step()
            optimizer.zero_grad()
            if index >= start:
                norms.append(norm)
        if index >= start:
            losses.append(float(loss.detach()))
    state = {name: t.detach().float().clone() for name, t in model.state_dict().items() if t.is_floating_point()}
    return {"losses": losses, "norms": norms, "state": state, "optimizer_states": len(optimizer.state),
            "adapters": adapter_names(model)}
