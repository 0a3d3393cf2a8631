"""eagle3flow: the logic behind the Snakemake workflow that trains EAGLE-3 drafts.

One folder per role (docs/architecture.md draws the tree and its one-way dependencies);
each stage's module has a ``main(argv)`` that its rule calls as
``python -m eagle3flow.<role>.<module>``. docs/formats.md gives every artifact's layout.
"""
