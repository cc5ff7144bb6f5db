-- roles.sql: the scheduler's least-privilege PostgreSQL roles.
--
-- What: creates (or, run again, brings up to date) three roles in the
-- database psql is connected to:
--   :owner     runs `scheduler migrate`: owns the schema and everything the
--              migrations create (River's and the scheduler's). Not a
--              superuser and needs none; it cannot create databases or roles.
--   :service   runs `scheduler run`: reads and writes the rows of every table
--              the owner creates, uses its sequences and functions. It cannot
--              create, alter, drop or truncate anything.
--   :operator  runs the runbook and the operator commands (status, ls, show,
--              held, expedite, cancel, park, replay, pause, resume, limit,
--              targets): reads everything; its writes (to deferred_message and
--              target_control only) are granted by grants.sql, after the
--              tables exist. It cannot change the schema or River's tables.
-- The grants are made as default privileges of the owner, so tables that later
-- migrations create get them too. See docs/security.md.
-- When: once, as an administrator (a superuser, or a role that may create
-- roles and is a member of the owner role), BEFORE the first
-- `scheduler migrate`; then run grants.sql after it. Running it again changes
-- nothing that is already right.
-- Call (every variable is optional; the defaults are shown):
--   psql "$ADMIN_URL" -v owner=scheduler_owner -v service=scheduler_service \
--        -v operator=scheduler_operator -v schema=public -f sql/roles/roles.sql
-- with -v owner_password=..., -v service_password=..., -v operator_password=...
-- to set passwords (or set them afterwards with psql's \password, which keeps
-- them out of the server's statement log).
-- With schema other than public, the schema is created, owned by :owner, and
-- made the search_path of the three roles in this database.

\set ON_ERROR_STOP on
\set QUIET on
\if :{?owner}
\else
  \set owner scheduler_owner
\endif
\if :{?service}
\else
  \set service scheduler_service
\endif
\if :{?operator}
\else
  \set operator scheduler_operator
\endif
\if :{?schema}
\else
  \set schema public
\endif

BEGIN;

-- A DO block cannot read psql variables; it reads them from these settings,
-- which last until the end of the transaction.
SELECT set_config('scheduler.owner', :'owner', true),
       set_config('scheduler.service', :'service', true),
       set_config('scheduler.operator', :'operator', true) \g /dev/null

-- Create the roles that do not exist yet. CREATE ROLE's defaults are the
-- least: no superuser, no CREATEDB, no CREATEROLE, no replication, no
-- BYPASSRLS. A role that exists already is kept, but refused if it has more
-- than that: a superuser or BYPASSRLS role would make every grant below
-- meaningless.
DO $$
DECLARE
    r text;
    mighty text;
BEGIN
    FOREACH r IN ARRAY ARRAY[current_setting('scheduler.owner'), current_setting('scheduler.service'),
                             current_setting('scheduler.operator')]
    LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) THEN
            EXECUTE format('CREATE ROLE %I LOGIN', r);
        END IF;
    END LOOP;
    SELECT string_agg(format('%I', rolname), ', ' ORDER BY rolname) INTO mighty
    FROM pg_roles
    WHERE rolname IN (current_setting('scheduler.owner'), current_setting('scheduler.service'),
                      current_setting('scheduler.operator'))
      AND (rolsuper OR rolbypassrls OR rolcreaterole OR rolcreatedb OR rolreplication);
    IF mighty IS NOT NULL THEN
        RAISE EXCEPTION 'role(s) % already exist with SUPERUSER, BYPASSRLS, CREATEROLE, CREATEDB or REPLICATION', mighty
            USING HINT = 'Use other role names (-v owner=... -v service=... -v operator=...), or take those attributes away first.';
    END IF;
    IF current_setting('scheduler.owner') IN (current_setting('scheduler.service'), current_setting('scheduler.operator'))
       OR current_setting('scheduler.service') = current_setting('scheduler.operator') THEN
        RAISE EXCEPTION 'owner, service and operator must be three different roles';
    END IF;
END
$$;

\if :{?owner_password}
ALTER ROLE :"owner" PASSWORD :'owner_password';
\endif
\if :{?service_password}
ALTER ROLE :"service" PASSWORD :'service_password';
\endif
\if :{?operator_password}
ALTER ROLE :"operator" PASSWORD :'operator_password';
\endif

-- Connecting. PUBLIC may connect by default; a hardened database revokes
-- that, so grant it by name.
GRANT CONNECT ON DATABASE :"DBNAME" TO :"owner", :"service", :"operator";

-- The schema. public is owned by the database owner (pg_database_owner), so
-- the owner role gets CREATE on it; any other schema is created for, and
-- owned by, the owner role.
SELECT format('CREATE SCHEMA IF NOT EXISTS %I AUTHORIZATION %I', :'schema', :'owner')
WHERE :'schema' <> 'public' \gexec
GRANT USAGE, CREATE ON SCHEMA :"schema" TO :"owner";
GRANT USAGE ON SCHEMA :"schema" TO :"service", :"operator";
-- Nobody else may create objects in public: PostgreSQL 15's default, which
-- older servers do not have. Otherwise the service and operator roles could
-- create tables there, and objects placed ahead of ours could capture
-- unqualified names.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
-- Unqualified names (all of the scheduler's and River's SQL) resolve through
-- search_path; point it at the schema for the three roles, in this database.
SELECT format('ALTER ROLE %I IN DATABASE %I SET search_path = %I', r, :'DBNAME', :'schema')
FROM unnest(ARRAY[:'owner', :'service', :'operator']) AS r
WHERE :'schema' <> 'public' \gexec

-- What the owner creates from now on (every migration) is granted as it is
-- created:
--   service: rows of every table (River's and the scheduler's), sequences
--            (ingest takes deferred_message.seq, River its job ids),
--            functions and types (River's river_job_state enum and bitmask
--            function). No TRUNCATE, REFERENCES or TRIGGER.
--   operator: reads every table. Its writes come from grants.sql.
-- PUBLIC can execute functions and use types by default; the grants by name
-- keep working where an administrator revoked that.
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"service";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT USAGE, SELECT ON SEQUENCES TO :"service";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT EXECUTE ON FUNCTIONS TO :"service", :"operator";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT USAGE ON TYPES TO :"service", :"operator";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA :"schema"
    GRANT SELECT ON TABLES TO :"operator";

COMMIT;

\echo roles ready: owner :owner, service :service, operator :operator, schema :schema
\echo next: scheduler migrate as :owner, then psql -f sql/roles/grants.sql as :owner
