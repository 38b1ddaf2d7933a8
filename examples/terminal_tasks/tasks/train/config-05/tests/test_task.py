import json

got = json.load(open('/app/app.json'))
want = {'name': 'api', 'timeout': 10}
assert got == want, f'{got!r} != {want!r}'
print('ok')
