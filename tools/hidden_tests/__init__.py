"""The hidden tests of each chapter, one module per chapter (`ch05` for chapters/05_*), collected by
tools/grading_specs.py into its `SPECS`."""
