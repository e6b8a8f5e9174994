"""A causal language model trained from scratch by Hugging Face's Trainer on a text file, in the shape of
transformers' examples/pytorch/language-modeling/run_clm.py (HfArgumentParser over the script's own
arguments and TrainingArguments, a model from --config_name, Trainer.train()), without `datasets`:
the text is read as bytes and cut into blocks (a byte is a token: --config_name's vocab_size is 256).

    torchrun --nproc-per-node 4 hf_trainer.py --config_name tiny/ --train_file text.txt --output_dir out \\
        --use_cpu --ddp_backend gloo --max_steps 3 --per_device_train_batch_size 2 --report_to none
"""

from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, set_seed


@dataclass
class DataArguments:
    config_name: str = field(metadata={"help": "a folder with the model's config.json"})
    train_file: str = field(metadata={"help": "a text file"})
    block_size: int = field(default=32, metadata={"help": "tokens (bytes) per training example"})


class Blocks(torch.utils.data.Dataset):
    """The file's bytes in blocks of block_size, each its own labels (the Trainer's causal LM shifts them)."""

    def __init__(self, path: str, block_size: int):
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        self.blocks = data[: len(data) // block_size * block_size].view(-1, block_size)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main():
    data_args, training_args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(training_args.seed)
    config = AutoConfig.from_pretrained(data_args.config_name)
    model = AutoModelForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=Blocks(data_args.train_file, data_args.block_size))
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)


if __name__ == "__main__":
    main()
