"""PCP's family: `cp::pcp_token_index`, a graph marker (`ops.py`); PCP's layout math
is shared (`core/pcp_layout.py`)."""
