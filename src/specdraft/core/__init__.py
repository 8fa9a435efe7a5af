"""Settings, files, statistics, acceptance accounting, the sampling filter and the losses: the ground floor.

May import: nothing else of specdraft (the standard library, numpy, pydantic; torch inside the functions
that need it).
"""
