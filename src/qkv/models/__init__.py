"""The three model families, one file each: encoder–decoder, encoder-only, decoder-only."""
