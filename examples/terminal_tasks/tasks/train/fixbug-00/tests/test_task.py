import sys
sys.path.insert(0, '/app')
from mathlib import first_char

for args, want in [(('hello',), 'h'), (('xy',), 'x'), (('q',), 'q')]:
    got = first_char(*args)
    assert got == want, f'first_char{args} = {got!r}, expected {want!r}'
print('ok')
