"""Pure tensor/string functions of IGPO: no verl, no Ray, no I/O."""
