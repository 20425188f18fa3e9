"""Drafter training: distillation and supervised fine-tuning."""
