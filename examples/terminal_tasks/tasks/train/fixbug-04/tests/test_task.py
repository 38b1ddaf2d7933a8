import sys
sys.path.insert(0, '/app')
from mathlib import is_positive

for args, want in [((5,), True), ((-3,), False), ((0,), False)]:
    got = is_positive(*args)
    assert got == want, f'is_positive{args} = {got!r}, expected {want!r}'
print('ok')
