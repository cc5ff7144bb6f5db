-- The console scenario's seed, step 5 (cmd/bench/console.go): the id
-- sequence past every id given out by hand ($1: the highest), and a few
-- target controls as operators leave them: two paused targets with notes
-- and one rate-limited hot target.
WITH ids AS (
    SELECT setval(pg_get_serial_sequence('deferred_message', 'id'), $1::bigint)
)
INSERT INTO target_control (target_topic, paused, rate_limit, note)
SELECT t.topic, t.paused, t.rate_limit, t.note
FROM ids, (VALUES ('team03.svc003', true, NULL::float8, 'downstream outage INC-4411, resume when their status page is green'),
                  ('team11.svc011', true, NULL, 'schema migration in progress'),
                  ('payments.retry', false, 200, 'provider allows 200 calls/s')) AS t (topic, paused, rate_limit, note)
