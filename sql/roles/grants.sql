-- grants.sql: the grants that need the scheduler's tables to exist.
--
-- What, for the roles roles.sql created:
--   - the operator may UPDATE and DELETE deferred_message (expedite, park,
--     replay, fix a rejected row; cancel), INSERT and UPDATE
--     target_control (pause, resume, limit) and DELETE deferred_inflight
--     (release a consumer group's keys); nothing else besides reading;
--   - the service only reads the migration bookkeeping (scheduler_migration,
--     river_migration): only `scheduler migrate`, as the owner, writes it;
--   - the triggers on deferred_message and target_control that keep
--     deferred_key and deferred_attempt true run as the owner (SECURITY
--     DEFINER, with search_path pinned to the schema and pg_temp last), so
--     that a role may edit those two tables without being allowed to write
--     the derived ones directly: the operator can expedite a message or
--     pause a target, and the heads follow, but cannot UPDATE deferred_key
--     itself;
--   - deferred_queue_analyze, which the service calls to ANALYZE the queue
--     tables when their statistics fall behind, and
--     deferred_sequences_advance, which it calls to move the id and seq
--     sequences past what it has seen after the database went back in
--     time, run as the owner too, with their search_path pinned the same
--     way;
--   - the service and the operator may call deferred_key_state, the
--     key-state query, and read deferred_inflight, which it reads, and
--     call deferred_lineage and deferred_lineage_history, which read the
--     history;
--   - objects the owner had before roles.sql set its default privileges (a
--     database migrated before the roles existed, then handed to the owner)
--     get the same grants as new ones.
-- When: after `scheduler migrate`, as the owner role (or an administrator),
-- with the same variables given to roles.sql. Run it again after every
-- `scheduler migrate` that applied something: a migration that replaces a
-- trigger function resets it to run as the caller. Running it again changes
-- nothing that is already right.
-- Call:
--   psql "$OWNER_URL" -v service=scheduler_service -v operator=scheduler_operator \
--        -v schema=public -f sql/roles/grants.sql

\set ON_ERROR_STOP on
\set QUIET on
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

-- Objects of the owner of deferred_message, in the schema: what
-- `scheduler migrate` created. Their grants, as roles.sql's default privileges
-- give them; a no-op for objects created after roles.sql.
SELECT format('GRANT SELECT, INSERT, UPDATE, DELETE ON %s TO %I', c.oid::regclass, :'service'),
       format('GRANT SELECT ON %s TO %I', c.oid::regclass, :'operator')
FROM pg_class c
WHERE c.relnamespace = :'schema'::regnamespace
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
  AND c.relowner = (SELECT relowner FROM pg_class WHERE oid = format('%I.deferred_message', :'schema')::regclass)
ORDER BY c.relname \gexec
SELECT format('GRANT USAGE, SELECT ON SEQUENCE %s TO %I', c.oid::regclass, :'service')
FROM pg_class c
WHERE c.relnamespace = :'schema'::regnamespace
  AND c.relkind = 'S'
  AND c.relowner = (SELECT relowner FROM pg_class WHERE oid = format('%I.deferred_message', :'schema')::regclass)
ORDER BY c.relname \gexec

-- The operator's writes. UPDATE covers expedite (next_run_at), park and
-- replay (state, reason, park_holds_key, redrive_count, attempt) and fixing
-- a rejected row by hand before replaying it (target_topic, ...): column
-- grants would break that last one. DELETE is cancel: the runbook's
-- cancel_id.sql and `scheduler cancel` delete the row, which is what the
-- README's SQL contract promises operators; the history in deferred_attempt
-- stays.
GRANT UPDATE, DELETE ON :"schema".deferred_message TO :"operator";
GRANT INSERT, UPDATE ON :"schema".target_control TO :"operator";
-- deferred_inflight: the service inserts and moves a key's row at finalize
-- (dispatch_delete.sql) and deletes it once the key's consumer group has
-- committed past it (the grant above gives it that already; named here
-- because the key-state query is wrong without it). The operator deletes
-- the rows of a group that will never commit (deleted, renamed, stuck):
-- release_inflight.sql and `scheduler release`.
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".deferred_inflight TO :"service";
GRANT DELETE ON :"schema".deferred_inflight TO :"operator";

-- The key-state query (POST /v1/key-state; operators call it by hand)
-- is deferred_key_state, which runs as its caller (not SECURITY DEFINER)
-- and so reads deferred_message and deferred_inflight with the caller's
-- rights. PUBLIC may execute functions and roles.sql's default privileges
-- give the rest; by name, it keeps working where an administrator revoked
-- that, or the objects predate roles.sql.
GRANT EXECUTE ON FUNCTION :"schema".deferred_key_state(text, text[]) TO :"service", :"operator";
GRANT SELECT ON :"schema".deferred_inflight TO :"service", :"operator";
-- The history as operators read it (history.sql, show_message.sql,
-- `scheduler show`, the console): deferred_lineage and
-- deferred_lineage_history run as their caller too, and read
-- deferred_attempt and deferred_message; the view deferred_history is
-- granted with the tables above.
GRANT EXECUTE ON FUNCTION :"schema".deferred_lineage(bigint), :"schema".deferred_lineage_history(bigint)
    TO :"service", :"operator";

-- Only `scheduler migrate` writes the migration bookkeeping.
REVOKE INSERT, UPDATE, DELETE ON :"schema".scheduler_migration, :"schema".river_migration FROM :"service";

-- The AFTER triggers of the tables the operator writes keep derived state:
-- those of deferred_message write deferred_key and deferred_attempt, those
-- of target_control flag the heads of a paused or rate-limited target in
-- deferred_key, and those of deferred_inflight release the lease of a key
-- that leaves flight. Trigger functions run as the role whose statement fired
-- them, so without this the operator would need to be allowed to write
-- those tables directly. BEFORE triggers only adjust the row being written
-- and stay as they are: they run once per row, and a SECURITY DEFINER call
-- costs a little more than a plain one.
SELECT DISTINCT format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = %I, pg_temp', t.tgfoid::regprocedure, :'schema')
FROM pg_trigger t
WHERE t.tgrelid IN (format('%I.deferred_message', :'schema')::regclass, format('%I.target_control', :'schema')::regclass,
                    format('%I.deferred_inflight', :'schema')::regclass)
  AND NOT t.tgisinternal
  AND t.tgtype & 2 = 0 -- not BEFORE
\gexec

-- deferred_queue_analyze (migration 0003) and deferred_sequences_advance
-- (migration 0005) are SECURITY DEFINER already, since ANALYZE needs the
-- owner and setval UPDATE on the sequences; their search_path is pinned the
-- same way.
SELECT format('ALTER FUNCTION %s SET search_path = %I, pg_temp', p.oid::regprocedure, :'schema')
FROM pg_proc p
WHERE p.proname IN ('deferred_queue_analyze', 'deferred_sequences_advance')
  AND p.pronamespace = :'schema'::regnamespace
\gexec

COMMIT;

\echo grants ready: service :service, operator :operator, schema :schema
