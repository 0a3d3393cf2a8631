"""eagle3flow: the logic behind the Snakemake workflow that trains EAGLE-3 drafts.

One module per concept; each stage module has a ``main(argv)`` the rules call as
``python -m eagle3flow.<module>``. See docs/formats.md for every artifact's layout.
"""
