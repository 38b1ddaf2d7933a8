import configparser

cp = configparser.ConfigParser()
assert cp.read('/app/app.ini'), 'missing /app/app.ini'
got = dict(cp['server'])
want = {'timeout': '60', 'workers': '7'}
assert got == want, f'{got!r} != {want!r}'
print('ok')
