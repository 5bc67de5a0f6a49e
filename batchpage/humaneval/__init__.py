"""HumanEval scoring: the sandbox that runs model-written code confined (sandbox, with its child
side in launcher), the code taken from an instruct model's reply (code_extract), and HumanEval's
checks and pass@1 (checks)."""
