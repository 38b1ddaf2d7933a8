got = {line.strip() for line in open('/app/app.env') if line.strip()}
want = set(['DEBUG=false', 'HOST=example.org'])
assert got == want, f'{got!r} != {want!r}'
print('ok')
