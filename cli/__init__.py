"""ringq's command line."""

import os

# transformers (the tokenizers' chat templates) announces on import that PyTorch is missing;
# ringq never needs PyTorch, and errors must stay one line on stderr.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
