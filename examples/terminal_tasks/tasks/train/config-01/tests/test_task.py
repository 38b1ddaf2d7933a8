import configparser

cp = configparser.ConfigParser()
assert cp.read('/app/app.ini'), 'missing /app/app.ini'
got = dict(cp['main'])
want = {'port': '8443', 'debug': 'false'}
assert got == want, f'{got!r} != {want!r}'
print('ok')
