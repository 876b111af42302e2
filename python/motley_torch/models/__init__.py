"""The models a rank trains: the reference GPT and Llama stages (`transformer`), tensor-parallel
layers (`tp`), Hugging Face weights in and out (`hf`, `hf_out`).
"""
