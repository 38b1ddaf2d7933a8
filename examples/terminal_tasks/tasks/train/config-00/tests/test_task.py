got = {line.strip() for line in open('/app/app.env') if line.strip()}
want = {'TIMEOUT=30', 'HOST=0.0.0.0'}
assert got == want, f'{got!r} != {want!r}'
print('ok')
