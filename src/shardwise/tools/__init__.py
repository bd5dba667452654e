"""Tools that show what each rank holds and sends."""
