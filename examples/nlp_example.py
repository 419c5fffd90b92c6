# Seed 002's BERT sequence-classification script, run by torchrig with only the import changed.
# Offline stand-ins (no hub is reachable here): a tiny BertConfig model instead of
# `from_pretrained("bert-base-uncased")`, and synthetic token ids instead of GLUE SST-2 +
# the tokenizer. The training part — Accelerator(), prepare, backward, step — is the seed's.
import torch
from torch.optim import AdamW
from torchrig import Accelerator  # the only torchrig-specific line (was: from accelerate import Accelerator)
from transformers import BertConfig, BertForSequenceClassification

# 1. Initialize Accelerator
accelerator = Accelerator()


# 2. Load data and model (offline stand-ins for load_dataset / from_pretrained)
def synthetic_sst2(num_examples=256, max_length=32, vocab_size=1000, seed=42):
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(num_examples):
        label = int(torch.randint(0, 2, (1,), generator=generator))
        # label-dependent tokens, so there is something to learn
        ids = torch.randint(1, vocab_size // 2, (max_length,), generator=generator) + label * (vocab_size // 2 - 1)
        examples.append({"input_ids": ids, "attention_mask": torch.ones(max_length, dtype=torch.long),
                         "labels": torch.tensor(label)})
    return examples


config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=64, num_labels=2)
model = BertForSequenceClassification(config)
optimizer = AdamW(model.parameters(), lr=1e-3)
train_dataset = synthetic_sst2()

# 3. Prepare everything with Accelerator
model, optimizer, train_loader = accelerator.prepare(
    model, optimizer, torch.utils.data.DataLoader(train_dataset, batch_size=8, shuffle=True)
)
# Training loop
for epoch in range(3):
    model.train()
    for batch in train_loader:
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.is_main_process:
        print(f"Epoch {epoch}, Loss: {loss.item():.4f}")
if accelerator.is_main_process:
    print("Training finished!")
