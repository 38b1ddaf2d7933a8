got = {line.strip() for line in open('/app/app.env') if line.strip()}
want = set(['HOST=0.0.0.0', 'TIMEOUT=30'])
assert got == want, f'{got!r} != {want!r}'
print('ok')
