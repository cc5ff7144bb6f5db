-- The console scenario's seed, step 2 (cmd/bench/console.go): live messages
-- $1..$2 of $3, as ingest would store them, with ids equal to g. The
-- statement triggers build their keys' heads (deferred_key) and their first
-- history event, as for a batch of ingest.
--
-- The shape, from g's bucket b = (g * 7919) % 1000 and its key
-- k = g % ($3 / 4) (about four messages a key, one in twenty unordered):
--   - the key names the target: half the keys go to three hot targets,
--     the rest spread over 197 team targets (team00.svc000 ...);
--   - b <  20: stored pending, then parked by dispatch (unknown_topic, step 3)
--   - b <  35: parked by ingest, exhausted (attempt 10)
--   - b <  45: parked by ingest, permanent
--   - b <  50: stored pending, then parked by an operator (step 3)
--   - b <  60: rejected (invalid_delay, target_not_allowed, missing_target)
--   - b <  80: pending and due (the service is not running: they wait)
--   - else:    pending, due from an hour to 30 days ahead
-- Messages tried before (attempt > 0, three in four) re-defer a delivered
-- message of step 1 (origin_id $3 + g). Payloads are a few hundred bytes
-- of JSON; stored over the last seven days (created_at).
INSERT INTO deferred_message (id, source_topic, source_partition, source_offset, business_key, target_topic,
    next_run_at, attempt, state, reason, error_class, error_message, origin_id, created_at, updated_at,
    key, value, header_keys, header_values, park_holds_key, parked_at, dlq_topic)
SELECT g, 'scheduler.defer', (g % 12)::int, g, s.business_key, s.target,
       s.due, s.attempt, s.state, s.reason, s.error_class,
       CASE WHEN s.error_class IS NOT NULL THEN s.error_class || ': upstream answered 503 after 30s (request ' || g || ')' END,
       CASE WHEN s.attempt > 0 THEN $3::bigint + g END,
       s.created, s.created,
       convert_to(coalesce(s.business_key, 'unordered-' || g), 'UTF8'),
       convert_to(json_build_object('order_id', g, 'customer', 'cust-' || s.k, 'amount_cents', g % 100000,
                                    'currency', 'EUR', 'items', json_build_array(json_build_object('sku', 'SKU-' || (g % 5000), 'qty', 1 + g % 4)),
                                    'note', repeat('x', 120))::text, 'UTF8'),
       ARRAY['trace-id', 'content-type', 'defer.target', 'defer.error.class', 'defer.attempt'],
       ARRAY[convert_to(md5(g::text), 'UTF8'), 'application/json'::bytea, convert_to(coalesce(s.target, ''), 'UTF8'),
             convert_to(coalesce(s.error_class, ''), 'UTF8'), convert_to(s.attempt::text, 'UTF8')],
       -- One target in five releases the key of a parked message.
       s.k % 5 <> 4,
       CASE WHEN s.state = 'parked' THEN s.created + interval '1 minute' END,
       CASE WHEN s.state = 'parked' AND s.k % 2 = 0 THEN 'scheduler.deadletter' END
FROM generate_series($1::bigint, $2::bigint) AS g
CROSS JOIN LATERAL (SELECT (g * 7919) % 1000 AS b, g % greatest($3::bigint / 4, 1) AS k) AS h
CROSS JOIN LATERAL (
    SELECT h.k,
           CASE WHEN g % 20 = 0 THEN NULL ELSE 'cust-' || h.k END AS business_key,
           CASE WHEN h.b >= 50 AND h.b < 60 AND h.b % 3 = 2 THEN NULL -- missing_target
                WHEN h.k % 10 < 5 THEN (ARRAY['orders.retry', 'payments.retry', 'emails.retry'])[h.k % 3 + 1]
                ELSE 'team' || lpad((h.k % 197 % 20)::text, 2, '0') || '.svc' || lpad((h.k % 197)::text, 3, '0') END AS target,
           CASE WHEN h.b >= 20 AND h.b < 45 THEN 'parked'
                WHEN h.b >= 50 AND h.b < 60 THEN 'rejected'
                ELSE 'pending' END AS state,
           CASE WHEN h.b >= 20 AND h.b < 35 THEN 'exhausted: defer.attempt 10 reached the policy''s maximum of 10'
                WHEN h.b >= 35 AND h.b < 45 THEN 'permanent: the consumer gave defer.error.class permanent'
                WHEN h.b >= 50 AND h.b < 60 THEN
                    (ARRAY['invalid_delay: defer.delay "soon" is not a positive Go duration',
                           'target_not_allowed: the target is not in TARGET_TOPICS',
                           'missing_target: no defer.target header'])[h.b % 3 + 1] END AS reason,
           CASE WHEN h.b >= 20 AND h.b < 35 THEN 10 ELSE (g % 4)::int END AS attempt,
           CASE WHEN h.b >= 35 AND h.b < 45 THEN 'permanent'
                WHEN g % 4 = 0 THEN NULL
                ELSE (ARRAY['ProviderTimeout', 'RateLimited', 'ConnectionReset'])[g % 3 + 1] END AS error_class,
           CASE WHEN h.b >= 60 AND h.b < 80 THEN now() - (g % 3600) * interval '1 second'
                ELSE now() + interval '1 hour' + (g * 104729 % 2592000) * interval '1 second' END AS due,
           now() - interval '7 days' + (g::float8 / $3::bigint) * interval '7 days' AS created
) AS s
ORDER BY g
