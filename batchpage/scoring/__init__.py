"""Scoring model-written code: the sandbox that runs it confined (sandbox, with its child side in
launcher), code taken from an instruct model's reply (code_extract) and HumanEval's checks and
pass@1 (humaneval)."""
