-- The console scenario's seed, step 1 (cmd/bench/console.go): the history
-- of delivered messages, which outlives them in deferred_attempt until
-- HISTORY_RETENTION prunes it. Messages $1..$2 of $3 each get a 'published'
-- row under ids $3 + g, above every live message's id (live message g has
-- id g), with their deferral folded in (deferred_at, the error), as
-- dispatch's finalize writes it for a message nothing else happened to
-- (migration 0012): stored over the last seven days in id order, delivered
-- 30 seconds later (the BRIN index on recorded_at expects that order), two
-- minutes before live message g was stored: about as many deliveries a
-- minute as deferrals. Live messages that were tried before (attempt > 0)
-- name one of these as their origin (defer.id), so their history opens
-- with a delivered ancestor's, as a re-deferral's does.
-- Written directly: nothing in deferred_message has these ids any more.
INSERT INTO deferred_attempt (lineage_id, message_id, event, attempt, error_class, target_topic, next_run_at,
                              recorded_at, partition, record_offset, deferred_at)
SELECT $3::bigint + g, $3::bigint + g, 'published', 1, 'ProviderTimeout',
       -- The target of live message g's key (console_seed_messages.sql).
       CASE WHEN (g % greatest($3::bigint / 4, 1)) % 10 < 5
            THEN (ARRAY['orders.retry', 'payments.retry', 'emails.retry'])[(g % greatest($3::bigint / 4, 1)) % 3 + 1]
            ELSE 'team' || lpad(((g % greatest($3::bigint / 4, 1)) % 197 % 20)::text, 2, '0') || '.svc'
                 || lpad(((g % greatest($3::bigint / 4, 1)) % 197)::text, 3, '0') END,
       t.at + interval '30 seconds',
       t.at + interval '30 seconds',
       (g % 12)::int,
       g,
       t.at
FROM generate_series($1::bigint, $2::bigint) AS g
CROSS JOIN LATERAL (SELECT now() - interval '7 days' - interval '2 minutes' + (g::float8 / $3::bigint) * interval '7 days' AS at) t
ORDER BY g
