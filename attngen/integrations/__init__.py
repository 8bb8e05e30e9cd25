"""Integrations with other libraries, each imported on its own (its library is an optional extra):

    transformers    attn_implementation="attngen" for Hugging Face models (pip install 'attngen[hf]')
"""
