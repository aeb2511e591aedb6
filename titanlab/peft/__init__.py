"""Parameter-efficient fine-tuning applied from outside the model (module swaps on the meta
model before `parallelize`): LoRA, QLoRA's NF4 base weights, their stored form.

May import `config` and `models`; exporting adapters is `titanlab.checkpoint.peft_export`, the
trainer's LoRA/QLoRA steps `titanlab.trainer.peft_steps`.
"""
