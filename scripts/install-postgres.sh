#!/usr/bin/env bash
# Installs PostgreSQL's server binaries (Debian package postgresql) when no
# initdb and pg_ctl are found, for `make demo`, `make bench` and `make chaos`,
# which start throwaway clusters from them (internal/pglocal). It looks where
# internal/pglocal.Binaries looks: PATH, then /usr/lib/postgresql/*/bin.
# Installing needs root and apt-get; otherwise it says what to do instead.
set -euo pipefail

have_binaries() {
	local dir
	local -a path_dirs
	IFS=: read -r -a path_dirs <<<"$PATH"
	for dir in "${path_dirs[@]}" /usr/lib/postgresql/*/bin; do
		if [[ -n $dir && -x $dir/initdb && -x $dir/pg_ctl ]]; then
			return 0
		fi
	done
	return 1
}

if have_binaries; then
	exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
	echo "PostgreSQL server binaries (initdb, pg_ctl) not found, and installing them needs root:" >&2
	echo "run 'sudo apt-get install postgresql', or set DATABASE_URL to an existing PostgreSQL server" >&2
	exit 1
fi
if ! command -v apt-get >/dev/null; then
	echo "PostgreSQL server binaries (initdb, pg_ctl) not found and apt-get is not available:" >&2
	echo "install them with your package manager, or set DATABASE_URL to an existing PostgreSQL server" >&2
	exit 1
fi
echo "+ apt-get install postgresql (server binaries for a throwaway cluster)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends postgresql </dev/null
have_binaries
