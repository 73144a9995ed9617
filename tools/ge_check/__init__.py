"""torchair GE-graph check: FX -> GE conversion of every cp:: op and the DCP model graphs, on CPU.

Runs torchair's real Python (the converter registry, `get_npu_backend` in
`max-autotune` mode, the FX -> GE conversion, its GE graph passes and dumps) with
one thing replaced: torchair's C++ extension `torchair.core._torchair`, by the
stand-in `tools.torchair_standin` (pinned to torch-npu 2.13.0). The
stand-in receives the serialised GE graph at `load`; the check reads it back and
asserts op types, attributes and shapes. Nothing is compiled by GE or run.

1. op graphs: each cp:: op alone (bf16, the shapes of a small GQA / MLA layer),
   through `torchair.get_npu_backend`: the op's GE op types and key attributes;
2. model graphs: the example models (Qwen3-style GQA, DeepSeek-style MLA) at tp = 4,
   dcp = 1 and dcp = 2 with both merges (`ag_rs`, `a2a`), compiled on 4 gloo ranks
   (ranks 0 and 1, one DCP group, build graphs), and the DeepSeek-V3.2-style sparse
   (SFA) model at tp = dcp = 2 (SFA DCP needs dcp == tp) on 2 more gloo ranks,
   through the public path (`cp_compile.compile_model(..., lowering="torchair",
   torchair_mode="max-autotune")` after `init_parallel`), so the DCP group names
   are real: every FX node has a converter, the GE graph holds the expected ops,
   and the collectives are HCCL ops on the DCP group (rank list and size), the TP
   all-reduce on the TP group;
3. `--with-unconverted-op` adds a graph with an op that has no converter: the
   check must then fail (the negative case the tests run);
4. by value (issue 21): every GE graph is run on CPU by `tools.ge_eval` (in place of
   the stand-in's `run`) and compared with its FX graph on the same inputs, outputs
   and mutated caches, every rank, under both readings of FIA's empty-row LSE
   (`tools/ge_eval/probe.py`); `CP_COMPILE_GE_CONVERTERS=DIR` loads converter copies
   from DIR instead of the library's, and `--mutations SPEC` checks op graphs with one
   converter module's text replaced (the mutation test), every importer of that module
   seeing the mutated copy (`converters.py`).

    TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv-torchair/bin/python -m tools.ge_check [--json F] [--dump DIR]

(`TORCH_DEVICE_BACKEND_AUTOLOAD=0`: with torch-npu installed, `import torch` would
otherwise try to load torch_npu, which needs CANN.) Exit status: 0 all converted
and as expected, 1 something failed, 2 not runnable here.

One module per part: `cli` (arguments, the run, table, JSON, exit status),
`op_graphs` (one call per cp:: op and its expectations), `model_graphs` (the DCP
example models on gloo ranks and their expectations), `reading` (the GE graph and the
value comparison read back into a `GraphResult`), `converters` (which converter code
runs: the library's, copies, or a mutation).
"""
